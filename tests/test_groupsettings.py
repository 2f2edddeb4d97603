"""Peers and auxiliary reducers build their averaging options from the same `[averaging]` section."""

from __future__ import annotations

from dilocod.config import load_config
from dilocod.node.groupsettings import averaging_settings
from dilocod.trust.adversary import AdversaryConfig, tampering_for
from peers.grouping import matchmaking_window


def test_aux_reducers_match_the_peers_except_for_their_seat_and_checks() -> None:
    cfg = load_config(
        None, ["averaging.group_size=4", "averaging.min_group_size=2", "averaging.compression=int8"]
    )
    peer, aux = averaging_settings(cfg, "node"), averaging_settings(cfg, "aux")
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
    assert averaging_settings(cfg, "client").check_part is None
    assert averaging_settings(cfg, "node").reply_part is None  # the reduced part goes back as it is
    lie = tampering_for(AdversaryConfig(mode="bad_reducer"), 0).reply_part()
    assert lie is not None and averaging_settings(cfg, "node", reply_part=lie).reply_part is lie


def test_the_matchmaking_window_grows_with_the_group_it_waits_for() -> None:
    # (configured window, members expected, matchmaking timeout, request timeout) → the leader's window
    table = [
        ((1.5, None, 8.0, 1.0), 1.5),  # no target known yet: as configured
        ((1.5, 4, 8.0, 1.0), 1.5),  # a small group: as configured
        ((1.5, 17, 8.0, 1.0), 4.25),  # 16 trainers and the bootstrap: 0.25 s each
        ((1.5, 33, 8.0, 1.0), 6.0),  # capped so matchmaking can end within its timeout (8 − 2 × 1)
        ((5.0, 17, 10.0, 3.0), 5.0),  # never below the configured window, even past that cap
    ]
    for args, window in table:
        assert matchmaking_window(*args) == window, args
