"""Typed KV-transfer failures. Every one means: free the blocks on both sides and re-prefill elsewhere."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """Base of every KV-transfer failure. The transfer did not happen; nothing is held for it any more."""


class LeaseExpiredError(KVTransferError):
    """The sender no longer holds the request's blocks (lease ran out, was reaped, acked or released)."""


class EpochMismatchError(KVTransferError):
    """The handle names an older (or newer) grant of the request than the sender's current one."""


class TransferTimeoutError(KVTransferError):
    """A send, receive, channel set-up or acknowledgement did not finish within its timeout."""


class PeerDiedError(KVTransferError):
    """The other side of the channel went away (process killed, socket closed) mid-transfer."""


class ReceiverOutOfBlocksError(KVTransferError):
    """The receiver has too few free KV blocks for the request; try another decode worker."""


class ProtocolError(KVTransferError):
    """An unexpected or corrupted message arrived (wrong request, size or header checksum).

    The channel is out of step after this and is closed by whoever detects it.
    """
