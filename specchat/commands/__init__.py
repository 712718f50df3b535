"""The subcommands of `specchat`, one module each (cli.py builds the parser from them)."""
