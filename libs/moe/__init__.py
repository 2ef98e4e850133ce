"""Mixture-of-experts support: routing recorded at inference, carried on the wire, replayed
by the trainer (router replay).

    routing   detect an MoE policy's routing shape; record and replay its routers' choices
    wire      routing as compact bytes on a rollout turn (zstd of little-endian small ints)
"""
