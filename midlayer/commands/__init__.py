"""The command line's verbs, one module per group (`cli.COMMANDS` maps every subcommand to its module): each
module has, per subcommand, `add_<name>(sub)` (its flags) and `cmd_<name>(args)` (the work, returning the
exit status), thin layers over the library. `options.py` holds what they share.

May import every layer. Only `cli` imports it.
"""
