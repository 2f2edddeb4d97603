"""Peers and auxiliary reducers build their averaging options from the same `[averaging]` section."""

from __future__ import annotations

from dilocod.config import load_config
from dilocod.processes.groupoptions import averaging_options


def test_aux_reducers_match_the_peers_except_for_their_seat_and_checks() -> None:
    cfg = load_config(
        None, ["averaging.group_size=4", "averaging.min_group_size=2", "averaging.compression=int8"]
    )
    peer, aux = averaging_options(cfg, "node"), averaging_options(cfg, "aux")
    assert peer.target_group_size == aux.target_group_size == 5  # one seat for an auxiliary reducer
    assert (
        peer.min_group_size == aux.min_group_size == 2
    )  # in trainers: matchmaking adds a seat per aux reducer
    assert peer.check_part is not None and aux.check_part is None  # an aux reducer receives no averages
    assert peer.reduce_part is not None and aux.reduce_part is not None
    assert peer.codec is not None and aux.codec is not None and peer.codec.name == aux.codec.name
    for name in ("min_matchmaking_time", "matchmaking_timeout", "allreduce_timeout", "request_timeout"):
        assert getattr(peer, name) == getattr(aux, name)


def test_the_undefended_mean_has_no_receiver_check_and_adversaries_are_opt_in() -> None:
    cfg = load_config(None, ["averaging.reducer=mean"])
    assert averaging_options(cfg, "client").check_part is None
    assert averaging_options(cfg, "node").corrupt_reductions is False
    assert averaging_options(cfg, "node", corrupt_reductions=True).corrupt_reductions is True
