"""What the mods of one message share about their site, loaded at most once per message.

Every message has a ClientApp process of its own, and Flower hands every mod the same `Context`. The
outermost mod but the pack's (`SiteScope`, installed by client_app.build_client_app) makes one `SiteEnv` per
message; every inner mod and the bare trainer call find it with `SiteEnv.current(context)`. The
site's bundle (its keys and the federation registry), its attestation settings, the parsed round
config, the trainer and the site store are each loaded on first use and then shared, instead of
once per mod.

Where state lives, chosen once: what must outlive the message lives either in Flower's
`context.state` (small records that belong to the current Flower run: a SecAgg round's secrets,
the site's attestation nonces and verdict) or in the site store on disk (site_store.py: the model
the site holds and its codec residual, which must also survive a SuperNode restart and a new run).
Nothing else is kept between messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from functools import cached_property
from typing import TypeVar

from flwr.app import Context, Message
from pydantic import BaseModel

from crypto.pki import SiteBundle
from federation.config import SiteAttestation
from federation.protocol import message_cost
from federation.protocol import message_keys as keys
from federation.protocol.pipeline import RoundContext
from federation.protocol.round_config import RoundConfig
from federation.site.site_store import SiteStore
from federation.site.trainer_call import NODE_CONFIG_HINT, Trainer
from site_trainer.policy_config import SitePolicy

M = TypeVar("M", bound=BaseModel)
_CURRENT: ContextVar["SiteEnv | None"] = ContextVar("sovfl_site_env", default=None)

TrainerFactory = Callable[["SiteEnv"], Trainer]


class SitePolicyError(RuntimeError):
    """The site's policy file cannot be read; the site refuses every round until it is fixed."""


class SiteAttestationError(RuntimeError):
    """This site cannot take part in attestation as configured; the message says how to fix it."""


class SiteEnv:
    """One message's view of its site: node config, keys, settings, round config, trainer, store."""

    def __init__(self, msg: Message, context: Context, trainer_for: TrainerFactory):
        self.msg, self.context = msg, context
        self.node_config = context.node_config
        try:
            self.site = str(self.node_config["site-id"])
        except KeyError as err:
            raise RuntimeError(f"SuperNode started without node config {err}; start it with {NODE_CONFIG_HINT}") from None
        self._trainer_for = trainer_for
        # the data path's files of this message (update_stream.py), released by the bulk mod:
        self.bulk_direct = False  # the reply's large Arrays will go on the coordinator's data path
        # the bulk mod's: send evaluation figures to the coordinator before the reply (None: no data path)
        self.report_evaluation: Callable[[dict[str, float]], None] | None = None
        self.downloads: list = []  # DownloadedBlob: the message's blobs, in /dev/shm files
        # the update's files the reply carried (carried.py), closed by the bulk mod when the message ends
        self.opened: list = []
        self.audit_events: list[tuple[str, dict]] = []  # (kind, fields) for the site's audit log (audit_mod.py)

    @staticmethod
    def current(context: Context) -> "SiteEnv | None":
        """The env of the message being handled with `context`, if a SiteScope made one."""
        env = _CURRENT.get()
        return env if env is not None and env.context is context else None

    @cached_property
    def bundle(self) -> SiteBundle | None:
        """The site's provisioned keys and peer registry (node config `bundle-dir`), or None."""
        return load_bundle(self.context)

    @cached_property
    def attestation(self) -> SiteAttestation | None:
        """The site's own attestation settings (node config `attestation-config`), or None."""
        return load_attestation(self.context)

    @cached_property
    def policy(self) -> SitePolicy | None:
        """The site's own policy (node config `site-policy`, a JSON file), or None: every round taken."""
        return node_file(self.node_config, "site-policy", SitePolicy, SitePolicyError, "site policy")

    @cached_property
    def config(self) -> RoundConfig:
        """The message's round config, parsed once (RoundConfigError if it does not parse)."""
        return RoundConfig.from_record(self.msg.content.config_records.get(keys.CONFIG))

    @cached_property
    def trainer(self) -> Trainer:
        """The site's trainer."""
        return self._trainer_for(self)

    @cached_property
    def store(self) -> SiteStore:
        """The site's store, under the workdir its trainer reports."""
        return SiteStore(self.trainer.workdir())

    def round_context(self) -> RoundContext:
        """This message's round, as the pipeline stages bind to it."""
        cfg = self.config
        return RoundContext(cfg.federation, int(self.msg.metadata.run_id), cfg.round, self.site, cfg.seed)


def load_bundle(context: Context) -> SiteBundle | None:
    """The site's bundle from node config `bundle-dir` (None without one)."""
    path = str(context.node_config.get("bundle-dir", "") or "")
    return SiteBundle.load(path) if path else None


def load_attestation(context: Context) -> SiteAttestation | None:
    """The site's attestation settings from node config `attestation-config` (None without)."""
    return node_file(context.node_config, "attestation-config", SiteAttestation, SiteAttestationError,
                     "attestation settings")


def node_file(node_config, key: str, model: type[M], error: type[Exception], what: str) -> M | None:
    """The site's own settings `model` from the JSON file node config `key` names (None without
    one); `error` says which file is unusable and why."""
    path = str(node_config.get(key, "") or "")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return model.model_validate_json(f.read())
    except (OSError, ValueError) as err:
        raise error(f"{what} {path}: unusable, {err}") from None


class SiteScope:
    """The outermost mod inside the pack (pack_mod.py): one SiteEnv per message for the mods inside, the relay's own time
    (`relay_s`) in the metrics of train and evaluate replies, and on every reply the wall-clock
    stamps that split the message's seconds (protocol/message_cost.py; `app_import_s`: what loading
    our app cost this process)."""

    def __init__(self, trainer_for: TrainerFactory, app_import_s: float | None = None):
        self.trainer_for = trainer_for
        self.app_import_s = app_import_s

    def __call__(self, msg: Message, context: Context, call_next) -> Message:
        """Handle `msg` with a fresh SiteEnv current."""
        started = time.time()
        t0 = time.perf_counter()
        token = _CURRENT.set(SiteEnv(msg, context, self.trainer_for))
        try:
            reply = call_next(msg, context)
        finally:
            _CURRENT.reset(token)
        if reply.has_content() and keys.METRICS in reply.content.metric_records:
            reply.content.metric_records[keys.METRICS]["relay_s"] = time.perf_counter() - t0
        if reply.has_content():
            message_cost.stamp(reply.content, started, time.time(), self.app_import_s)
        return reply


def site_env(context: Context) -> SiteEnv:
    """The current SiteEnv; mods run only inside a SiteScope (client_app.build_client_app)."""
    env = SiteEnv.current(context)
    if env is None:
        raise RuntimeError("site mods run inside SiteScope; build the ClientApp with client_app.build_client_app")
    return env
