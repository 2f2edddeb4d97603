"""dilocod: a peer-to-peer daemon for DiLoCo language-model pre-training over the internet."""

__version__ = "0.2.0"
DEFAULT_RUN_ID = "dilocod"  # every configs/*.toml uses it, so a bare bootstrap shows them
