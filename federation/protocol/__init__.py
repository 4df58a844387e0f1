"""What both sides share: message keys, the typed round config, wire records, the update pipeline
and its codecs, and the halves of each message format. Imports neither side, nor the config
schema, nor ops (README.md)."""
