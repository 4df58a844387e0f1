"""The names both sides give the records of a message, in one place.

A coordinator and a site can only disagree on a key if one of them spells it by hand; every
module of federation/ takes its keys from here (as Flower's SecAgg+ takes its own from
`secaggplus_constants.py`). Plain strings and ints: imports nothing.

A train or evaluate message (coordinator -> site) carries CONFIG and GLOBAL, plus DOWNLINK when a
downlink codec is on, SECAGG in a secure-aggregation round's train message (stage 3), and ATTEST
in the query messages of attested admission. Every reply (site -> coordinator) carries STATUS; a
train reply adds METRICS and either UPDATE + UPDATE_META (plain rounds) or SECAGG_CHUNKS + SECAGG
(masked input).
"""

# coordinator -> site
CONFIG = "config"  # ConfigRecord: the typed round config (round_config.RoundConfig)
GLOBAL = "global"  # ArrayRecord: the global model, or the downlink steps towards it
DOWNLINK = "downlink"  # ConfigRecord: how GLOBAL applies to the model a site holds (downlink_steps.py)
SECAGG = "secagg"  # ConfigRecord: a SecAgg+ request, and the site's reply to it (secagg_records.py)
ATTEST = "attest"  # ConfigRecord: a step of attested admission (coordinator/admission.py)

# site -> coordinator
STATUS = "status"  # ConfigRecord: site, ok, error, and what the message type adds (num_examples, ...)
METRICS = "metrics"  # MetricRecord: the site's figures for the round's metrics line
UPDATE = "update"  # ArrayRecord: the update, after the site's pipeline (codec, envelope)
UPDATE_META = "update_meta"  # ConfigRecord: the update's metadata
SECAGG_CHUNKS = "secagg_chunks"  # ArrayRecord: one uint32 Array per masked chunk, keyed by word offset

# fields of STATUS
MODEL_DIGEST = "model_digest"  # the model a site holds after a downlink message
MANIFEST = "manifest"  # discovery reply: the site's base-model manifest, JSON (coordinator/manifest_check.py)

# SecAgg+ stages (crypto/secagg): 1, 2 and 4 travel in query messages, 3 in the train message
ADVERTISE, SHARE_KEYS, MASKED_INPUT, UNMASK = 1, 2, 3, 4
STAGE_NAMES = {ADVERTISE: "advertise keys", SHARE_KEYS: "share keys", MASKED_INPUT: "masked input",
               UNMASK: "unmask"}
