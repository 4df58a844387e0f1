"""The envelope, the site's side, as a mod: every update leaves its site signed with the site's
Ed25519 key over (federation, run, round, site, payload digest), and sealed to the coordinator's
(attested) X25519 key when the round config says `seal`. A masked (SecAgg) update is not
enveloped: the sum is what opens, and the SecAgg mod signs its own messages. Without a bundle the
update leaves unsigned, and a coordinator with a PKI rejects it.
"""

from __future__ import annotations

import sys

from flwr.app import Context, Message, MessageType

from crypto.envelope import make_envelope
from crypto.pki import SiteBundle
from federation.protocol import message_keys as keys
from federation.protocol.envelope_layout import as_payload, inner
from federation.protocol.pipeline import Payload, RoundContext
from federation.site.carried import carry, take
from federation.site.replies import ok, set_update, update_of
from federation.site.site_env import site_env
from federation.site.update_stream import reader_records, seal_to_file


class SiteProtection:
    """`Stage` that signs (and seals) the outgoing payload with the site's provisioned keys."""

    name = "protection"

    def __init__(self, bundle: SiteBundle, seal: bool):
        self.bundle, self.seal = bundle, seal

    def encode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """The payload inside a signed (and maybe sealed) envelope, as it goes on the wire."""
        buf, signed_meta = inner(payload)
        env = make_envelope(buf, signing_key=self.bundle.sign_key, federation_id=self.bundle.federation_id,
                            run_id=ctx.run_id, round=ctx.round, site=self.bundle.name, meta=signed_meta,
                            seal_to=self.bundle.coordinator_seal_public if self.seal else None)
        return as_payload(env)

    def decode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """Not the site's job: the coordinator opens envelopes (coordinator/envelope_opener.py)."""
        raise NotImplementedError("sites do not open envelopes")


def protection_mod(msg: Message, context: Context, call_next) -> Message:
    """Envelope the update of a good train reply (not under SecAgg, not without a bundle)."""
    if msg.metadata.message_type != MessageType.TRAIN or keys.SECAGG in msg.content.config_records:
        return call_next(msg, context)
    reply = call_next(msg, context)
    env = site_env(context)
    if not ok(reply) or env.bundle is None:
        return reply
    source = take(reply)
    if source is not None:  # the update is still the trainer's file: seal it a chunk at a time
        try:
            sealed = seal_to_file(source, env.bundle, env.config.seal, env.round_context(),
                                  meta=dict(reply.content.config_records.get(keys.UPDATE_META, {})))
        except OSError as err:  # no room for the sealed file: envelope it whole, as without the data path
            print(f"[sovfl site] site {env.site}: cannot write the sealed update to a file ({err}); "
                  "sealing it in memory", file=sys.stderr, flush=True)
            reply.content[keys.UPDATE] = reader_records(source)
            source.close()
        else:
            source.close()
            carry(reply, sealed, env.opened)  # the bulk mod uploads the file (or puts the body in the message)
            reply.content[keys.UPDATE], reply.content[keys.UPDATE_META] = sealed.records()
            reply.content.metric_records[keys.METRICS]["upload_bytes"] = float(sealed.body_len)
            return reply
    set_update(reply, SiteProtection(env.bundle, seal=env.config.seal).encode(update_of(reply), env.round_context()))
    return reply
