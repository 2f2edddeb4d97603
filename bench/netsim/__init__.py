"""A discrete-event simulation of a dilocod run at internet scale (issue 44): N peers, their links, NAT,
churn, the DHT and the bootstrap, on a simulated clock, deterministic for a seed.

What it runs of the project's own code (every decision a peer makes): the run clock
(`dilocod.rounds.clock`: `in_round`, `estimate_close`, `joining`, `group_target`, `should_stop`,
`refresh_interval`), the round machine (`dilocod.rounds.machine.transition` with the events and facts of
`dilocod.rounds.events` / `dilocod.rounds.facts.run_facts`), the settings the daemon derives from its config
(`dilocod.node.roundconfig`, `dilocod.node.autodeadlines`), matchmaking rules and group keys
(`peers.grouping.matchmaking_window`, `round_group_bits`, `reducer_bandwidths`, `share_by_bandwidth`), the
link budget and adaptive deadlines (`peers.linkbudget`, `peers.deadlines.AdaptiveDeadlines`), the chunk
schedule the bootstrap keeps (`dilocod.data.schedule.ChunkBook`), the scoring assignment
(`dilocod.trust.scoring.assign_scorers`) and the state-download plan (`dilocod.statesync.parts.pick_donors`,
`peers.state.share.part_size`, `peers.state.parts.split_parts` / `PartPlan`).

What it models, because it is network I/O and not a function (`costs.py` says each formula's source): the
all-reduce's bytes and seconds (a member sends its parts to the reducers and gets their averages back; a
reducer moves its share of every other member's Δ both ways, docs/protocol.md), DHT operations (O(log N)
hops at the links' latency; a read of a run key returns every subkey's record, from each replica), hivemind's
leader/follower matchmaking (`matchmaking.py`), transfer times (bytes ÷ the slower side's rate), compute
(tokens/s from a speed distribution) and churn (Poisson leaves, crashes and joins).
"""
