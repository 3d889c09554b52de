"""The pure parts every algorithm shares: seeded streams, zeroth-order math, optimizers, slots, digests."""
