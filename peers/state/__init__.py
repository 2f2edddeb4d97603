"""A node's θ_global and outer momentum over the wire: served in parts and downloaded from several donors
at once (`share`, `download`, the part plan in `parts`), served whole to the run's key holders and fetched
whole from one donor (`donors`), and the host's side of a download through hivemind's averager (`fetch`)."""
