"""The `[averaging]` section as the options of a `peers.group.GroupAverager`: one place for peers and
auxiliary reducers (bootstrap, helper), which must match in everything but their seat."""

from __future__ import annotations

from dilocod.aggregation.partrules import make_part_check, make_part_reduce, make_part_weigh
from dilocod.config import Config
from peers.group import AveragingSettings
from peers.linkbudget import LinkRule
from peers.partreduce import PartReply


def averaging_settings(
    cfg: Config,
    mode: str,
    *,
    run_tag: str | None = None,
    link: LinkRule | None = None,
    reply_part: PartReply | None = None,
    check_reducers: bool = True,
) -> AveragingSettings:
    """Options for a trainer ("node" or "client") or an auxiliary reducer ("aux") of the run `cfg`;
    `run_tag` is the run manifest's hash (only nodes of the same manifest meet); `link`: the auto
    deadlines that follow the measured link (`dilocod.node.autodeadlines.resolve_deadlines`)."""
    avg = cfg.averaging
    aux = mode == "aux"
    return AveragingSettings(
        # The size a group aims for until the round driver sets it to the run's live trainers (plus
        # reducers) every round: one seat more than group_size for the bootstrap or a helper.
        target_group_size=avg.group_size + 1,
        # A group holds every live trainer of the run; at most group_size of them reduce.
        max_reducers=avg.group_size,
        # Counted in trainers: matchmaking adds one for each auxiliary reducer in the forming group
        # (peers/averager.py, BanAwareMatchmaking), whichever member leads it.
        min_group_size=avg.min_group_size,
        min_matchmaking_time=avg.min_matchmaking_time,
        matchmaking_timeout=avg.matchmaking_timeout,
        allreduce_timeout=avg.allreduce_timeout,
        request_timeout=avg.request_timeout,
        adaptive_deadlines=avg.adaptive_deadlines,
        deadline_factor=avg.deadline_factor,
        min_allreduce_timeout=avg.min_allreduce_timeout,
        bandwidth=cfg.net.bandwidth,
        mode=mode,
        # Every reducer of the run reduces alike, screened and robust (an honest peer would otherwise see an
        # auxiliary reducer's averages as implausible and ban it).
        reduce_part=make_part_reduce(avg.reducer_settings(), avg.screening_settings()),
        # topk's parts are relayed: the reducer weighs them by the sparse rule, every member combines them.
        weigh_part=make_part_weigh(avg.screening_settings()),
        # A trainer checks the averages it receives; `mean` is the undefended baseline, with no check either.
        check_part=None
        if aux or avg.reducer == "mean" or not check_reducers
        else make_part_check(avg.screening_settings()),
        # The run's codec: every reducer decodes, reduces and re-encodes alike.
        codec=avg.wire_codec(),
        reply_part=reply_part,  # a test-only adversary's lie (trust/hooks.py); None for every honest node
        run_tag=run_tag,
        link=link,
    )
