"""dilocod: a peer-to-peer daemon for DiLoCo language-model pre-training over the internet."""

__version__ = "0.1.0"
