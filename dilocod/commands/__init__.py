"""The CLI's subcommands, one module each: `join`, `bootstrap`, `demo`, `status`, `config` (reference.py),
`data`, `export` and `generate` (export.py). Each registers its parser (`add_parser`) and runs
(`run`); `dilocod/cli.py` builds the parser from them and dispatches. The nodes these commands start and the
services they are wired from are `dilocod/node/`. Importing a command is cheap (argparse only): the whole
parser is built on every command, and `dilocod status` must not pay for torch or hivemind.
"""
