"""The update codec, the site's side, as a mod: compress the trainer's update with error feedback.

The residual (what a lossy codec did not send yet) lives in the site store beside the downlink
reference (site_store.py), so it survives restarts and never travels back to the trainer; a round
run again after a coordinator resume starts from the residual its first attempt started from, and one
after a round whose update was not aggregated (an aborted SecAgg round) from the residual of the last
round that was: the round config says which (RoundConfig.aggregated). The
codec spec, its error-feedback flag and the round's seed come from the round config.
"""

from __future__ import annotations

import os

from flwr.app import Context, Message, MessageType

from federation.protocol import message_keys as keys
from federation.protocol.codecs import Arrays, CodecStateError
from federation.protocol.pipeline import Payload, Pipeline, RoundContext
from federation.protocol.round_config import RoundConfig
from federation.protocol.update_codec import CodecStage
from federation.site.replies import fail, ok, set_update, update_of
from federation.site.site_env import site_env

SITE_SEED = "codec-site-seed"  # simulation-only node config: reproducible stochastic rounding
# TEST HOOK: the same seed from the environment, for tests that run `sovfl simulate` (which sets no
# node config) and compare runs bit for bit; never set in production (rounding noise from the OS)
TEST_SITE_SEED = "SOVFL_TEST_CODEC_SITE_SEED"


def rounding_seed(context: Context) -> int | None:
    """The site's seed for stochastic rounding (the codec's and SecAgg's fixed point), or None:
    fresh noise from the OS, as in production."""
    seed = context.node_config.get(SITE_SEED) or os.environ.get(TEST_SITE_SEED)
    return None if seed in (None, "") else int(seed)


def codec_mod(msg: Message, context: Context, call_next) -> Message:
    """Encode the update of a good train reply; keep the new residual for the next round."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    reply = call_next(msg, context)
    if not ok(reply):
        return reply
    env = site_env(context)
    cfg = env.config
    metrics = reply.content.metric_records[keys.METRICS]
    if cfg.codec == "identity":
        metrics["state_arrays_in"] = 0.0
        return reply
    base = cfg.aggregated_round(env.site)  # the last round whose update from us was aggregated
    residual = env.store.residual.load(before=cfg.round, at=base) if cfg.error_feedback else {}
    payload, new_state, figures = encode_update(update_of(reply).arrays, residual, cfg, env.round_context(),
                                                site_seed=rounding_seed(context))
    if new_state is not None:
        try:
            env.store.residual.save(new_state, cfg.round, protect=base)
        except OSError as err:
            return fail(msg, env.site, f"could not keep the codec state for the next round: {err}")
    set_update(reply, payload)
    metrics.update({**figures, "state_arrays_in": float(len(residual))})
    return reply


def encode_update(arrays: Arrays, state: Arrays, cfg: RoundConfig | dict, ctx: RoundContext,
                  site_seed: int | None = None) -> tuple[Payload, Arrays | None, dict[str, float]]:
    """The codec stage on an update: the encoded payload, the residual to keep for the next round
    (None: unchanged) and figures for the round's line. `site_seed` makes stochastic rounding
    reproducible (simulations); None draws OS entropy."""
    cfg = RoundConfig.of(cfg)
    dense = {"upload_bytes": float(sum(a.nbytes for a in arrays.values())),
             "dense_bytes": float(sum(a.nbytes for a in arrays.values()))}
    if cfg.codec == "identity":
        return Payload(arrays), None, dense
    codec = CodecStage.from_spec(cfg.codec, cfg.error_feedback, state=state, site_seed=site_seed)
    try:
        payload = Pipeline((codec,)).encode(Payload(arrays), ctx)
    except CodecStateError:  # the model changed shape since the residual was kept: start afresh
        codec.state = {}
        payload = Pipeline((codec,)).encode(Payload(arrays), ctx)
    return payload, codec.new_state, {**dense, "upload_bytes": float(payload.nbytes), "encode_s": codec.encode_s}
