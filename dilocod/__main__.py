from dilocod.cli import entry

entry()
