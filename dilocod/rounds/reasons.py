"""Why a peer is not contributing: the one line it logs (once) and shows in `/api/status`.

A peer whose work does not reach θ_global must never be silent about it. After a few rounds in a row
without a successful round while other trainers are live, the round machine asks for the reason it can
tell, most specific first: settings that differ from the run's (it can never meet the others), a ban,
no reducer for a peer behind NAT, lagging behind the run's clock, then what its rounds ended as.
"""

from __future__ import annotations

from dilocod.rounds.events import Outcome, RunFacts


def not_contributing_reason(outcome: Outcome, facts: RunFacts, *, private: bool) -> str:
    if facts.other_settings is not None:
        differ = (
            f"it differs from ours in {', '.join(facts.other_settings_keys)}"
            if facts.other_settings_keys
            else "compare `dilocod status` or GET /api/run/manifest on a node of the run with ours"
        )
        return (
            f"other settings than the run: every other peer runs manifest {facts.other_settings[:12]}, not "
            f"ours; {differ} (join with `dilocod join <maddr>` and no run-wide settings to take the run's)"
        )
    if outcome is Outcome.BANNED:
        return "banned: most of our group refuses our contributions (see the bans in its peers' logs)"
    if no_reducer(facts, private=private):
        return (
            "no peer of this run can reduce for a private peer: there is no public reducer in this run, and "
            "behind NAT we average only through one (start the bootstrap without --no-reduce, or run a public "
            "peer / a relay: `dilocod bootstrap --relay`)"
        )
    if facts.late_by is not None and facts.late_by > 0:
        return (
            f"behind the run's clock by {facts.late_by:.1f}s: its rounds close before we reach them "
            "(a slow link or state download, or this machine paused)"
        )
    if outcome is Outcome.NO_GROUP and private:
        return (
            f"no group forms with us at the run's rounds, though {facts.reducers} node(s) of the run can "
            "reduce for a private peer: they do not meet us (check that the bootstrap or helper runs the "
            "run's dilocod version and reaches us; its log says which rounds it reduced)"
        )
    return _by_outcome(outcome)


def no_reducer(facts: RunFacts, *, private: bool) -> bool:
    """A definite diagnosis, worth saying at once: behind NAT, with others to average with but nobody
    who can reduce for us."""
    return private and facts.reducers == 0 and facts.others > 0


def _by_outcome(outcome: Outcome) -> str:
    if outcome is Outcome.LATE:
        return "behind the run's clock: its rounds close before we reach them"
    if outcome is Outcome.FAILED:
        return "our groups' rounds fail before they complete (see the round warnings above)"
    if outcome is Outcome.DIVERGED:
        return "our θ_global keeps differing from the run's, and re-syncing does not fix it"
    if outcome is Outcome.SYNC_FAILED:
        return "we cannot download θ_global from any peer to get back in step"
    return "no group forms with us at the run's rounds (are the other peers reachable?)"
