"""The site's side: the ClientApp, a bare call to the site's trainer wrapped in Flower mods
(attestation, SecAgg+, envelope, downlink, codec), and the site's store. Torch-free: Flower starts
one ClientApp process per message. Never imports federation.coordinator or federation.ops (README.md)."""
