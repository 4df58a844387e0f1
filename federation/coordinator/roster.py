"""The roster: which Flower node is which configured site.

Sites say who they are in answer to a discovery query (site name, examples, base manifest, data
path, channel key); the roster enrols them (`enrol`, one `assign_site` per reply), keeps a claim on a
site another node still holds until that node goes offline (a SuperNode restarted under a new node
id gets its site back that way), and asks nodes that connected since (`discover_late`). Which
configured sites a round samples is `sample`: a function of the federation seed and the round.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from federation.config.schema import ExperimentConfig
from federation.coordinator.exchange import MessageExchange
from federation.coordinator.strategy import Exchange, ExchangeResult, Rider, Site
from federation.protocol import message_keys as keys
from federation.protocol.status_record import StatusError, num_examples, site_name, step_s_estimate

LATE_TRIES = 3  # discovery queries to a node that connected late and does not answer

# a node took its site: (node, site, its discovery status)
Enrolled = Callable[[int, str, ConfigRecord], None]


def sample(cfg: ExperimentConfig, rnd: int) -> list[str]:
    """The sites of round `rnd`: `sites_per_round` of the configured sites (all if unset), drawn
    from the federation seed and the round alone, so any round's sample is known ahead."""
    fed = cfg.federation
    names = sorted(s.id for s in cfg.sites)
    k = min(fed.sites_per_round or len(names), len(names))
    rng = np.random.default_rng([fed.seed, rnd])
    return sorted(names[i] for i in rng.choice(len(names), size=k, replace=False).tolist())


class Roster:
    """The sites that answered discovery, by node; late joiners and claims on held sites.

    `admit(site, status)`: whether a site's discovery answer is acceptable (the base manifest
    check); `request()`: the records of a discovery query (beside its empty CONFIG); `on_enrol`: told each node that takes
    its site; `on_status`: told every discovery answer of an enrolled node (the link book)."""

    def __init__(self, cfg: ExperimentConfig, exchange: MessageExchange, progress: Callable[[str], None],
                 admit: Callable[[str, ConfigRecord], bool], request: Callable[[], dict]):
        self.cfg, self.exchange, self.progress = cfg, exchange, progress
        self.admit, self.request = admit, request
        self.on_enrol: list[Enrolled] = []
        self.on_status: list[Callable[[str, ConfigRecord], None]] = []
        self.sites: dict[int, Site] = {}
        self.discovered: set[int] = set()  # nodes that answered a discovery (not asked again)
        self.late_tries: Counter[int] = Counter()  # discovery queries to nodes that connected late
        self.claims: dict[int, tuple[str, ConfigRecord]] = {}  # node -> a site another online node holds
        self.channel_keys: dict[str, bytes] = {}  # site -> SecAgg channel key told at discovery (no bundle)

    def site_name(self, node: int) -> str:
        """The name a node gave at discovery (node-<id> for one that never did)."""
        site = self.sites.get(node)
        return site.name if site else f"node-{node}"

    def known_name(self, node: int) -> str | None:
        """The name a node gave at discovery, None before."""
        site = self.sites.get(node)
        return site.name if site else None

    def node_of(self, name: str) -> int | None:
        """The node that answered discovery as `name`."""
        return next((n for n, s in self.sites.items() if s.name == name), None)

    def candidates(self) -> list[int]:
        """The nodes a rider may address: every site discovered."""
        return sorted(self.sites)

    def discover_all(self, within_s: float, riders: Callable[[list[int]], list[Rider]]) -> ExchangeResult:
        """Wait until every configured site's node connected (at most `within_s`), ask them who they
        are with `riders(nodes)` aboard, and enrol them; the discovery's result."""
        want, end = len(self.cfg.sites), time.monotonic() + within_s
        nodes: list[int] = []
        while time.monotonic() < end:
            nodes = list(self.exchange.grid.get_node_ids())
            if len(nodes) >= want:
                break
            time.sleep(0.5)
        self.progress(f"{len(nodes)}/{want} site(s) connected")
        found = self.discovery(nodes, riders(nodes), self.cfg.federation.deadlines.connect_s, "discovery")
        self.enrol_replies(found)
        return found

    def discovery(self, nodes: list[int], riders: list[Rider], deadline_s: float, stage: str) -> ExchangeResult:
        """Ask `nodes` who they are (site name, examples, base manifest, channel key), `riders` aboard."""
        records = self.request()
        self.exchange.riders = riders
        try:
            return self.exchange.exchange(Exchange(stage, "query", nodes, lambda n: RecordDict(
                {keys.CONFIG: ConfigRecord({}), **records}), deadline_s))
        finally:
            self.exchange.riders = []

    def enrol_replies(self, res: ExchangeResult, online: set[int] | None = None) -> None:
        """Take the sites that answered a discovery (`assign_site`), `online` the nodes the SuperLink lists now."""
        for reply in res.replies:
            node = reply.message.metadata.src_node_id
            self.assign_site(node, reply.status, online)
            if self.known_name(node) is not None:
                for heard in self.on_status:
                    heard(self.site_name(node), reply.status)
        for name, reason in res.failed.items():
            self.progress(f"site discovery: {name} failed: {reason}")

    def assign_site(self, node: int, status: ConfigRecord, online: set[int] | None) -> None:
        """`node` says it is the site in `status`. A site name held by another node that is still
        `online` (None: always, the first discovery) stays with that node and the claim is kept: it is
        taken once that node is gone, which is how a SuperNode restarted under a new node id (no
        provisioned key) gets its site back without being asked again."""
        self.discovered.add(node)
        try:
            site, examples = site_name(status), num_examples(status)
        except StatusError as err:
            self.progress(f"ignoring node {node}: its discovery reply is malformed ({err.detail})")
            return
        if site not in {s.id for s in self.cfg.sites}:
            self.progress(f"ignoring node {node}: site '{site}' is not in the configuration")
            return
        old = self.node_of(site)
        if old is not None and (online is None or old in online):
            if node not in self.claims:
                self.progress(f"ignoring node {node}: site '{site}' already answered from node {old} "
                              "(taken over if that node goes offline)")
            self.claims[node] = (site, status)
            return
        self.claims.pop(node, None)
        if not self.admit(site, status):
            return
        if old is not None:
            del self.sites[old]
            self.progress(f"site {site} is back as node {node} (its node {old} is offline)")
        self.sites[node] = Site(node, site, examples, step_s_estimate(status))
        for enrolled in self.on_enrol:
            enrolled(node, site, status)
        pk = status.get("secagg_channel_pk")
        if isinstance(pk, bytes) and len(pk) == 32:
            self.channel_keys[site] = pk

    def discover_late(self, rnd: int) -> ExchangeResult | None:
        """Before round `rnd`: nodes that connected since discovery (a site started late, or a
        SuperNode restarted under a new node id) are asked who they are and join from this round
        (the round's preparation asks their SecAgg setup and evidence); a kept claim on a site
        whose node has gone offline is taken. A node is asked until it answers, at most LATE_TRIES
        times."""
        if self.exchange.grid is None:
            return None
        online = set(self.exchange.grid.get_node_ids())
        for node, (site, status) in list(self.claims.items()):
            if node not in online:
                del self.claims[node]
            elif self.node_of(site) not in online:
                self.assign_site(node, status, online)
        new = sorted(n for n in online - set(self.sites) - self.discovered if self.late_tries[n] < LATE_TRIES)
        if not new:
            return None
        self.late_tries.update(new)
        self.progress(f"round {rnd}: {len(new)} node(s) connected since discovery; asking who they are")
        deadlines = self.cfg.federation.deadlines
        res = self.discovery(new, [], min(deadlines.connect_s, deadlines.round_s), f"discovery before round {rnd}")
        self.enrol_replies(res, online)
        return res
