"""The configuration schema: one YAML file describes a federation, its workload and its sites.

Everything is validated before any process starts; an invalid file is rejected with a message
that names the file, the field and what to do about it. configs/README.md describes every field.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from crypto.secagg import SecAggConfig
from federation.config.attestation_config import AttestationConfig
from federation.config.restart_config import SiteRestarts
from federation.config.strict import StrictModel
from federation.config.supernode_polls import SupernodePolls
from federation.protocol.codecs import CodecError, parse_codec_config, validate_for_protection
from site_trainer.config import SiteConfig, WorkloadConfig, check_privacy_workload
from tracking.config import TrackingConfig


class Deadlines(StrictModel):
    """Every wait has a deadline (seconds)."""

    connect_s: float = Field(120.0, gt=0, description="wait for sites to connect to the SuperLink")
    round_s: float = Field(300.0, gt=0, description="one round's train stage, all sites")
    evaluate_s: float = Field(120.0, gt=0, description="one round's evaluate stage")
    trainer_start_s: float = Field(300.0, gt=0, description="a site trainer service to come up")
    secagg_stage_s: float = Field(30.0, gt=0, description="each key-exchange and unmask stage of a "
                                  "secure-aggregation round (the masked-input stage uses round_s)")
    superlink_retry_s: float = Field(120.0, gt=0, description="how long one call to the SuperLink is retried "
                                     "on its transient errors (HTTP 5xx, connection reset, `database is locked`) "
                                     "before the run gives up (then `--resume` continues it)")


class DataPath(StrictModel):
    """The bulk data path beside Flower (federation/protocol/bulk.py): where large Arrays travel."""

    enabled: bool = Field(True, description="models and updates on the coordinator's data path (mutual TLS); "
                          "false: everything through Flower")
    inline_max_bytes: int = Field(1 << 20, ge=0, description="Arrays of at least this many bytes leave the "
                                  "Flower message; smaller ones stay inline")
    streams: int = Field(4, ge=1, le=32, description="parallel streams (each its own TCP connection) per transfer")


class LinkPlan(StrictModel):
    """The link probe and the per-round choice of codec and local steps (`round_target_s`)."""

    probe: bool | Literal["auto"] = Field("auto", description="measure each site's link (RTT, throughput up and "
                                          "down) at discovery; auto: when round_target_s is set")
    probe_seconds: float = Field(0.5, gt=0, le=30, description="each direction is measured at least this long")
    probe_max_bytes: int = Field(32 << 20, ge=1 << 16, le=1 << 30, description="bytes each direction moves at "
                                 "most per measurement (the rate is then a lower bound, `capped` in the figures)")
    probe_streams: int = Field(1, ge=0, le=32, description="streams the throughput is measured on (0: as many as "
                               "a transfer, data_path.streams); one by default: see federation/site/link_probe.py")
    probe_flower_bytes: int = Field(4 << 20, ge=1 << 16, le=1 << 30, description="bytes a probe of a site "
                                    "without the data path sends each way through Flower")
    probe_every: int = Field(0, ge=0, description="measure again before every N-th round (0: at discovery only)")
    codecs: list[str] | None = Field(None, min_length=1, description="the ladder round_target_s chooses from, least "
                                     "lossy first (default: float32, int8, topk:0.1+int8, topk:0.01+int8; under "
                                     "secagg: identity, int8:clip=C, randk:0.1+int8:clip=C, randk:0.01+int8:clip=C)")
    link_share: float = Field(0.5, gt=0, le=1, description="the share of round_target_s the slowest site's "
                              "transfer may take; the local steps fill the rest")
    min_local_steps: int = Field(1, ge=1, description="the fewest local steps a round is given")
    max_local_steps: int = Field(1000, ge=1, description="the most local steps a round is given")

    @field_validator("codecs")
    @classmethod
    def _codecs_parse(cls, specs: list[str] | None) -> list[str] | None:
        for spec in specs or []:
            try:
                parse_codec_config(spec)
            except CodecError as err:
                raise ValueError(str(err)) from None
        return specs

    @model_validator(mode="after")
    def _steps_ordered(self) -> "LinkPlan":
        if self.min_local_steps > self.max_local_steps:
            raise ValueError(f"min_local_steps ({self.min_local_steps}) exceeds max_local_steps ({self.max_local_steps})")
        return self


class FederationConfig(StrictModel):
    """What the coordinator runs."""

    name: str = Field("sovfl", pattern=r"^[A-Za-z0-9_.-]+$", description="binds envelopes and SecAgg contexts")
    rounds: int = Field(3, ge=1, description="rounds to run")
    sites_per_round: int | None = Field(None, ge=1, description="sample this many sites; all if unset")
    quorum: int = Field(1, ge=1, description="fewest successful sites for a round to count")
    strategy: Literal["fedavg", "fedadam", "fedyogi", "diloco"] = Field(
        "fedavg", description="the server (outer) optimizer; diloco: SGD with Nesterov momentum on the mean delta")
    update_kind: Literal["weights", "delta"] = Field("delta", description="what sites send back")
    server_lr: float | None = Field(None, gt=0, description="default: 1.0 for fedavg, 0.7 for diloco, "
                                    "0.05 for fedadam/fedyogi")
    server_beta1: float = Field(0.9, ge=0, lt=1, description="fedadam/fedyogi: decay of the first moment")
    server_beta2: float = Field(0.99, ge=0, lt=1, description="fedadam/fedyogi: decay of the second moment")
    server_tau: float = Field(1e-3, gt=0, description="fedadam/fedyogi: the adaptivity (added to the root of "
                              "the second moment)")
    server_momentum: float | None = Field(None, ge=0, lt=1, description="diloco only: the outer momentum "
                                          "(default 0.5; DiLoCo's 0.9 suits many workers and long rounds)")
    server_nesterov: bool | None = Field(None, description="diloco only: Nesterov momentum (default true, "
                                         "DiLoCo's); false: heavy-ball")
    evaluate: bool = Field(True, description="evaluate the global model on every site after each round")
    overlap: bool = Field(False, description="sites keep training while their update travels and fold the next "
                          "global model in when it arrives (a one-round-delayed outer step; configs/README.md)")
    overlap_max_steps_factor: float = Field(1.0, ge=1.0, le=1000.0, allow_inf_nan=False, description=(
        "with overlap: a site's background steps go on until the next request arrives, at most this many "
        "times the answered round's local_steps; 1 (default): stop at local_steps, as before. Above 1 a "
        "round may hold more steps than local_steps (how many depends on the link's timing)"))
    seed: int = Field(0, description="sampling, round seeds of shared-seed codecs, downlink steps")
    deadlines: Deadlines = Field(Deadlines(), description="every wait's deadline, in seconds")
    codec: str = Field("identity", description="update codec spec, e.g. 'topk:0.01+int8' (see configs/README.md)")
    error_feedback: bool = Field(True, description="keep what a lossy codec did not send, per site, for the next round")
    secagg: SecAggConfig = Field(SecAggConfig(enabled=False), description="SecAgg+ secure aggregation: the "
                                 "coordinator learns only the weighted sum of the sites' updates "
                                 "(crypto/secagg/README.md)")
    seal: bool = Field(False, description="seal every update to the coordinator's (attested) key")
    audit: bool = Field(True, description="keep the coordinator's signed audit log (audit.jsonl in its workdir, "
                        "with a bundle) and send each round's terms, which sites with a policy judge")
    attestation: AttestationConfig = Field(AttestationConfig(), description="attested admission of sites before "
                                           "each round and appraisal of the coordinator by the sites")
    downlink_codec: str = Field("identity", description="codec of the global model sent to sites, e.g. 'int8' "
                                "(configs/README.md); any codec, also with secagg; identity: dense")
    checkpoint_keep: int = Field(3, ge=1, description="coordinator checkpoints kept on disk (one per round; "
                                 "`--resume` falls back to an older one if the newest is damaged)")
    site_restarts: SiteRestarts = Field(default_factory=SiteRestarts, description="restart budget of each site's "
                                        "trainer pool and SuperNode (federation/config/restart_config.py)")
    warm_clientapps: int = Field(1, ge=0, le=32, description="warm ClientApp parents each site keeps started ahead "
                                 "of its messages (imports done); each message is served by a worker forked from "
                                 "one. More than 1 only keeps a spare while a killed parent is replaced. "
                                 "0: Flower's own executor, a fresh process per message")
    supernode_polls: SupernodePolls = Field(default_factory=SupernodePolls, description="how soon each site's "
                                            "SuperNode asks for its next message after a reply "
                                            "(federation/config/supernode_polls.py)")
    data_path: DataPath = Field(default_factory=DataPath, description="the bulk data path beside Flower")
    receive_workers: int = Field(3, ge=1, le=32, description="SecAgg+ masked replies the coordinator checks and "
                                 "adds at once, each on a thread of its own, while it pulls the next; it holds at "
                                 "most this many replies (1: one after the other). Results do not depend on it")
    round_target_s: float | None = Field(None, gt=0, description="choose each round's codec (from link.codecs) and "
                                         "local steps so that the slowest site's transfer and compute fit this many "
                                         "seconds, from the measured links (off when unset)")
    link: LinkPlan = Field(default_factory=LinkPlan, description="the link probe and round_target_s's choices")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="the coordinator's experiment "
                                     "trackers (TensorBoard, MLflow, W&B, plug-ins): each round's metrics line, live")

    @field_validator("downlink_codec")
    @classmethod
    def _downlink_codec_parses(cls, spec: str) -> str:
        try:
            parse_codec_config(spec)
        except CodecError as err:
            raise ValueError(str(err)) from None
        return spec

    @property
    def probing(self) -> bool:
        """Whether sites' links are measured (link.probe, auto: with round_target_s)."""
        return self.link.probe is True or (self.link.probe == "auto" and self.round_target_s is not None)

    @property
    def codec_ladder(self) -> list[str]:
        """The codecs round_target_s chooses from, least lossy first."""
        if self.link.codecs:
            return list(self.link.codecs)
        if self.secagg.enabled:
            c = repr(self.secagg.clip)  # exactly SecAgg's clip: the codec's grid is then its ring's (secagg_levels)
            return ["identity", f"int8:clip={c}", f"randk:0.1+int8:clip={c}", f"randk:0.01+int8:clip={c}"]
        # float32 rather than identity: a dense round through the codec sends what lossy rounds left
        # in the error-feedback residual (identity skips the codec and would leave it behind)
        return ["float32", "int8", "topk:0.1+int8", "topk:0.01+int8"]

    @model_validator(mode="after")
    def _ladder_fits_protection(self) -> "FederationConfig":
        if self.round_target_s is None:
            return self
        for spec in self.codec_ladder:
            try:
                validate_for_protection(spec, self.protection)  # type: ignore[arg-type]
            except CodecError as err:
                raise ValueError(f"link.codecs: {err}") from None
        return self

    @property
    def protection(self) -> str:
        """How updates are protected: "secagg" (masked), "sealed" or "none" (signed only)."""
        return "secagg" if self.secagg.enabled else ("sealed" if self.seal else "none")

    @model_validator(mode="after")
    def _codec_fits_protection(self) -> "FederationConfig":
        try:
            validate_for_protection(self.codec, self.protection)  # type: ignore[arg-type]
        except CodecError as err:
            raise ValueError(f"codec: {err}") from None
        return self

    @model_validator(mode="after")
    def _server_fields_fit_strategy(self) -> "FederationConfig":
        # a setting the chosen optimizer would ignore is a mistake the user should hear about
        given = [f for f in ("server_momentum", "server_nesterov") if getattr(self, f) is not None]
        if given and self.strategy != "diloco":
            raise ValueError(f"{' and '.join(given)} only apply to strategy diloco (strategy is {self.strategy}): "
                             "remove them or set strategy: diloco")
        return self

    @property
    def effective_server_lr(self) -> float:
        """server_lr, or its default for the strategy (1.0 for FedAvg, 0.7 for DiLoCo, 0.05 for FedAdam/FedYogi)."""
        # FedAdam/FedYogi steps are normalised, so lr 1.0 would move every weight by ~1 per round;
        # DiLoCo's outer lr 0.7 (Douillard et al. 2023), with the momentum below.
        if self.server_lr is not None:
            return self.server_lr
        return {"fedavg": 1.0, "diloco": 0.7}.get(self.strategy, 0.05)

    @property
    def effective_server_momentum(self) -> float:
        """server_momentum, or 0.5.

        DiLoCo's 0.9 was tuned for 8 workers and 500 local steps a round. With a few sites, tens of
        local steps and overlap (each update one round stale), Nesterov at 0.9 makes the steady outer
        step 0.7/(1-0.9) = 7 times the mean delta and the global loss overshoots and rises in some
        rounds; at 0.5 it is 1.4 times, the loss falls round after round and still moves faster than
        plain averaging (benchmarks/outer_step_stability.py)."""
        return 0.5 if self.server_momentum is None else self.server_momentum

    @property
    def effective_server_nesterov(self) -> bool:
        """server_nesterov, or DiLoCo's true."""
        return True if self.server_nesterov is None else self.server_nesterov


class ExperimentConfig(StrictModel):
    """A whole run: federation, workload and sites (the unit `sovfl simulate` takes)."""

    federation: FederationConfig = Field(FederationConfig(), description="what the coordinator runs")
    workload: WorkloadConfig = Field(WorkloadConfig(), description="the model, data and loop every site trains "
                                     "(default: the digits task)")
    sites: list[SiteConfig] = Field(min_length=1, description="the sites, one entry each")

    @model_validator(mode="after")
    def _consistent(self) -> "ExperimentConfig":
        ids = [s.id for s in self.sites]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"site ids must be unique; repeated: {dup}")
        n = len(self.sites)
        if self.federation.quorum > n:
            raise ValueError(
                f"federation.quorum ({self.federation.quorum}) exceeds the number of sites ({n}); "
                f"lower it to at most {n}"
            )
        sample = self.federation.sites_per_round or n
        if sample > n:
            raise ValueError(f"federation.sites_per_round ({sample}) exceeds the number of sites ({n})")
        if self.federation.quorum > sample:
            raise ValueError(
                f"federation.quorum ({self.federation.quorum}) exceeds sites_per_round ({sample})"
            )
        att = self.federation.attestation
        if att.enabled:
            unknown = sorted(set(att.site_overrides) - set(ids))
            if unknown:
                raise ValueError(f"federation.attestation.site_overrides names unknown site(s) {unknown}; sites: {ids}")
            # what each site will run, checked now (a dev issuer's paths are filled in at launch)
            probe = att.with_dev_issuer(Path("dev-issuer"), "dev", "dev", "00") if att.dev_issuer else att
            for site in ids:
                try:
                    probe.for_site(site)
                except ValidationError as err:
                    raise ValueError(f"federation.attestation.site (for site {site}): "
                                     + "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}"
                                                 for e in err.errors())) from None
        parts = [s.partition for s in self.sites]
        if sorted(parts) != list(range(n)):
            raise ValueError(
                f"site partitions must be 0..{n - 1}, each used once; got {parts}"
            )
        for site in self.sites:  # sites[].privacy
            check_privacy_workload(self.workload, site)
        if self.federation.overlap:
            _check_overlap(self.workload, self.sites)
        elif self.federation.overlap_max_steps_factor != 1.0:
            raise ValueError(f"federation.overlap_max_steps_factor is {self.federation.overlap_max_steps_factor:g} "
                             "but federation.overlap is off: it caps the background steps of overlap; set "
                             "federation.overlap: true, or remove overlap_max_steps_factor")
        private = [s.id for s in self.sites if s.privacy.enabled]
        if self.federation.round_target_s is not None and private:
            raise ValueError(f"federation.round_target_s chooses each round's local steps, but sites {private} plan "
                             "their privacy budget over rounds x local_steps: unset round_target_s or privacy")
        if self.workload.task is not None and any(s.workload_options for s in self.sites):
            from site_trainer.workload_loader import check_sites  # imports the task: only when needed

            check_sites(self.workload, self.sites)  # a script is checked on its site, when it starts
        return self


def _check_overlap(workload: WorkloadConfig, sites: list[SiteConfig]) -> None:
    """federation.overlap runs background steps in the built-in loop: a script owns its steps, and
    DP-SGD would spend budget on steps that may be discarded."""
    if workload.script is not None:
        raise ValueError("federation.overlap needs the built-in training loop (workload.task); a script workload "
                         "runs its own steps, which the trainer cannot continue between rounds: set "
                         "federation.overlap: false")
    scripted = [s.id for s in sites if s.script is not None]
    private = [s.id for s in sites if s.privacy.enabled]
    if scripted:
        raise ValueError(f"federation.overlap needs the built-in training loop; site(s) {scripted} run their own "
                         "script (sites[].script): remove it or set federation.overlap: false")
    if private:
        raise ValueError(f"federation.overlap with sites[].privacy on site(s) {private}: background steps would spend "
                         "privacy budget on steps that a skipped round discards; set federation.overlap: false or "
                         "privacy.enabled: false")


class ConfigError(ValueError):
    """A configuration file is invalid; the message says where and how to fix it."""


def _format_errors(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid configuration ({err.error_count()} problem(s)):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        hint = ""
        if e["type"] == "extra_forbidden":
            hint = " — unknown field; check its spelling against configs/README.md"
        elif e["type"] == "missing":
            hint = " — required; add it"
        elif e.get("input") is not None and e["type"] not in ("value_error",):
            hint = f" (got {_short_repr(e['input'])})"
        lines.append(f"  - {loc}: {msg}{hint}")
    return "\n".join(lines)


MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB
MAX_FLOW_BRACKETS = 10_000  # PyYAML's scanner is quadratic in flow nesting: 5000 deep already takes ~2 s
MAX_FLOW_DEPTH = 64  # a real configuration nests a few levels; 600 levels already cost 0.2 s to scan
MAX_NODES = 100_000  # YAML nodes once aliases are expanded: refuses "billion laughs" documents


def _short_repr(value: Any) -> str:
    """repr of a config value for a message: bounded in size, depth and digits (never raises)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = 80
    try:
        return r.repr(value)
    except (ValueError, RecursionError):  # e.g. an int beyond sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses documents whose aliases expand beyond MAX_NODES nodes."""

    def construct_document(self, node: yaml.Node) -> Any:
        sizes: dict[int, int] = {}

        def expanded(n: yaml.Node) -> int:
            if id(n) not in sizes:
                sizes[id(n)] = 0  # a cycle (&a [*a]) counts once: it adds no expansion
                children = n.value if isinstance(n, yaml.SequenceNode) else (
                    [v for kv in n.value for v in kv] if isinstance(n, yaml.MappingNode) else [])
                sizes[id(n)] = min(MAX_NODES + 1, 1 + sum(expanded(c) for c in children))
            return sizes[id(n)]

        if expanded(node) > MAX_NODES:
            raise yaml.YAMLError(f"the document expands to more than {MAX_NODES} nodes through aliases "
                                 "(a YAML alias bomb?)")
        return super().construct_document(node)


def _flow_depth(text: str) -> int:
    """The deepest run of unclosed '[' / '{' (quotes ignored: an over-estimate only for odd strings)."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


def parse_config(data: object, source: str | Path = "<config>") -> ExperimentConfig:
    """Validate an already-parsed mapping; errors name `source`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a YAML mapping at the top level, got {type(data).__name__}")
    try:
        # relative paths in the file (a workload script) are the file's, not the working directory's
        context = {"config_dir": str(Path(source).parent)} if str(source) != "<config>" else None
        return ExperimentConfig.model_validate(data, context=context)
    except ValidationError as err:
        raise ConfigError(_format_errors(Path(source), err)) from None
    except RecursionError:  # a Python document nested (or self-referencing) past the validator's stack
        raise ConfigError(f"{source}: nested too deeply to be a configuration") from None
    except UnicodeError:  # a lone surrogate ("\ud800" in YAML) cannot be encoded into an error message
        raise ConfigError(f"{source}: a string holds a lone UTF-16 surrogate (an escape such as \\ud800); "
                          "remove it or write the character itself") from None


def load_config(path: str | Path) -> ExperimentConfig:
    """Read and validate a YAML experiment file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; pass a path like configs/demo.yaml") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {len(raw)} bytes; a configuration file is at most {MAX_CONFIG_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8") from None
    if text.count("[") + text.count("{") > MAX_FLOW_BRACKETS:
        raise ConfigError(f"{path}: more than {MAX_FLOW_BRACKETS} '[' or '{{': not a configuration")
    if (depth := _flow_depth(text)) > MAX_FLOW_DEPTH:
        raise ConfigError(f"{path}: '[' / '{{' nested {depth} deep (at most {MAX_FLOW_DEPTH}): not a configuration")
    try:  # the pure-Python loader: libyaml's CSafeLoader segfaults on deep nesting (50,000 levels)
        data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a configuration") from None
    except ValueError as err:  # e.g. an integer literal beyond Python's int/str conversion limit
        raise ConfigError(f"{path}: unusable value: {err}") from None
    return parse_config(data, path)
