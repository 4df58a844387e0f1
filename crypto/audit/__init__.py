"""Tamper-evident audit logs: signed, hash-chained JSON lines per party (log.py), checked alone
and against the other party's copy of the heads (verify.py). No torch, no flwr."""

from .log import LOG_NAME, AuditLog, AuditLogError, Head, digest_of, log_path
from .verify import Verdict, compare, verify

__all__ = ["LOG_NAME", "AuditLog", "AuditLogError", "Head", "Verdict", "compare", "digest_of", "log_path", "verify"]
