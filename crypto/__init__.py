"""Cryptography for sovereign-fl: numpy + `cryptography` only (no torch, no flwr).

Recipes here are built from `cryptography`'s primitives; the math we write ourselves (Shamir,
ring arithmetic, mask expansion) is property-tested.
"""
