"""The names both sides give the records of a message, in one place.

A coordinator and a site can only disagree on a key if one of them spells it by hand; every
module of federation/ takes its keys from here (as Flower's SecAgg+ takes its own from
`secaggplus_constants.py`). Plain strings and ints: imports nothing.

A train or evaluate message (coordinator -> site) carries CONFIG and GLOBAL, plus DOWNLINK when a
downlink codec is on, SECAGG in a secure-aggregation round's train message (stage 3). Any message
may carry ATTEST (attested admission, both ways) and SECAGG_SETUP (the plan of a coming SecAgg
round), whose answers ride back in the reply under the same keys; the discovery query carries
DISCOVER, and PROBE when the link is to be measured (discovery or a probe query). Every reply
(site -> coordinator) carries STATUS; a train reply adds METRICS and either UPDATE + UPDATE_META
(plain rounds) or SECAGG_CHUNKS + SECAGG (masked input).
"""

# coordinator -> site
CONFIG = "config"  # ConfigRecord: the typed round config (round_config.RoundConfig)
GLOBAL = "global"  # ArrayRecord: the global model, or the downlink steps towards it
DOWNLINK = "downlink"  # ConfigRecord: how GLOBAL applies to the model a site holds (downlink_steps.py)
SECAGG = "secagg"  # ConfigRecord: a SecAgg+ stage-3 or -4 request, and the reply (secagg_records.py)
SECAGG_SETUP = "secagg_setup"  # ConfigRecord: a coming round's plan, and the site's setup for it
ATTEST = "attest"  # ConfigRecord: attested admission, both ways (coordinator/admission.py)
DISCOVER = "discover"  # ConfigRecord: site discovery (who are you, how much data)
BULK = "bulk"  # ConfigRecord: to a site on the data path: which Arrays leave the reply, on how many streams
PROBE = "probe"  # ConfigRecord: measure the link and report it in STATUS (protocol/link_probe.py)
PROBE_PAYLOAD = "probe_payload"  # ArrayRecord: bytes a Flower-path probe carries, either way
TERMS = "terms"  # ConfigRecord: to a train message, the round's terms a site's policy judges (site_terms.py)
AUDIT = "audit"  # ConfigRecord: the coordinator's audit-log head (index, hash), witnessed by the site

# site -> coordinator
STATUS = "status"  # ConfigRecord: site, ok, error, and what the message type adds (num_examples, ...)
METRICS = "metrics"  # MetricRecord: the site's figures for the round's metrics line
UPDATE = "update"  # ArrayRecord: the update, after the site's pipeline (codec, envelope)
UPDATE_META = "update_meta"  # ConfigRecord: the update's metadata
SECAGG_CHUNKS = "secagg_chunks"  # ArrayRecord: one packed uint8 Array per masked chunk, keyed by word offset
MSG_COST = "msg_cost"  # MetricRecord: any reply: when its ClientApp process and handler ran (message_cost.py)

# either way
PACKED = "packed"  # ConfigRecord: the message's small records as one object on Flower's path (record_pack.py)

# fields of DISCOVER
DOWNLINK_TARGET = "downlink_target"  # the digest of the coordinator's downlink reference (a downlink codec on)

# fields of STATUS
MODEL_DIGEST = "model_digest"  # the model a site holds after a downlink message (discovery: if it is DOWNLINK_TARGET)
STEP_S_ESTIMATE = "step_s_estimate"  # discovery reply: the trainer's seconds per local step, timed at its start
AUDIT_INDEX, AUDIT_HASH = "audit_index", "audit_hash"  # any reply: the site's audit-log head, witnessed
MANIFEST = "manifest"  # discovery reply: the site's base-model manifest, JSON (coordinator/manifest_check.py)
POLICY = "policy"  # discovery reply: the site's policy, JSON, when it announces it (coordinator/policy_forecast.py)

# SecAgg+ steps (crypto/secagg): the setup of round r rides on a message of round r - 1 (or on
# discovery), the masked input on round r's train message, the unmask on a query
SETUP, MASKED_INPUT, UNMASK = 2, 3, 4
STAGE_NAMES = {SETUP: "setup", MASKED_INPUT: "masked input", UNMASK: "unmask"}
