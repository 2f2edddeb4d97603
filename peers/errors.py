"""Errors the networking layer raises to its caller, each with a one-line message for the user."""


class PeersError(Exception):
    """A networking failure the daemon reports to the user and does not crash on."""
