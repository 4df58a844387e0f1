"""``nvidia-nras`` attester: a site's GPUs attested by NVIDIA's supported tooling, not its SDK.

The site runs a command it configures (NVIDIA's ``nvattest`` CLI, or a short script that posts
the GPU evidence to NRAS) with ``{nonce}`` replaced by the binding (SHA-256(nonce ‖ SHA-256(key)),
64 hex characters), and reads NRAS's response JSON from its standard output:
``[["JWT", overall token], {"GPU-0": detached token, ...}]`` (or an object holding it under
``result_key``). Nothing is parsed beyond that shape here: the verifier appraises it.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from .attester import Attester
from .models import Evidence, b64url, binding
from .sev_snp_attester import DeviceError


class NrasCommandAttester(Attester):
    format = "nvidia-nras"

    def __init__(self, party: str, command: list[str], result_key: str | None = None, timeout_s: float = 120.0):
        super().__init__(party)
        if not command or not all(isinstance(a, str) for a in command) or not any("{nonce}" in a for a in command):
            raise TypeError("command is a list of strings, one of which holds {nonce}")
        self.command, self.result_key, self.timeout_s = list(command), result_key, timeout_s

    def attest(self, nonce: bytes, public_key: bytes) -> Evidence:
        n = binding(nonce, public_key).hex()
        argv = [a.replace("{nonce}", n) for a in self.command]
        try:
            proc = subprocess.run(argv, capture_output=True, timeout=self.timeout_s, check=False)  # noqa: S603
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DeviceError(f"GPU attestation command {argv[0]!r} did not run: {exc}") from None
        if proc.returncode != 0:
            raise DeviceError(f"GPU attestation command {argv[0]!r} exited {proc.returncode}: "
                              f"{proc.stderr.decode(errors='replace')[-300:]}")
        try:
            out: Any = json.loads(proc.stdout)
            if self.result_key is not None:
                out = out[self.result_key]
        except (ValueError, KeyError, TypeError):
            raise DeviceError(f"GPU attestation command printed no NRAS result JSON"
                              f"{' under ' + repr(self.result_key) if self.result_key else ''}") from None
        if not (isinstance(out, list) and len(out) == 2 and isinstance(out[1], dict)):
            raise DeviceError('the command\'s output is not NRAS\'s [["JWT", token], {"GPU-0": token, ...}]')
        return Evidence(format=self.format, attester=self.party, nonce=b64url(nonce), public_key=b64url(public_key),
                        payload=json.dumps(out))
