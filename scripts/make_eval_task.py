"""Write evals/arith.jsonl: 100 two-number arithmetic questions (seed 0), the local lm-eval task of issue 45.

    python scripts/make_eval_task.py          # deterministic: the committed file is what it writes

A task that needs no download: lm-eval reads it through the `json` dataset builder (evals/midlayer_arith.yaml).
"""
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "evals" / "arith.jsonl"


def main(out: Path = OUT) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(100):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        op = rng.choice("+-")
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out} ({len(rows)} questions)")
    return out


if __name__ == "__main__":
    main()
