"""Networking: tensor codecs, wire protocol, DHT records, RPC transport and the averaging wrapper.

Only this package imports hivemind; the rest of the code sees plain Python and torch tensors.
Importing the package does nothing (no DHT, no daemon, no environment changes).
"""
