"""KV-cache transfer between prefill and decode workers: leases, packing, transports, protocol.

No Ray in here; deployments/cluster/kv_endpoint.py is the Ray glue. Each module imports only modules
listed below it (no cycles, no imports inside functions to dodge one):

    factory              make_transport -> DeviceTransport: per peer gloo, NCCL, or staged (one GPU)
    endpoints            KVSender / KVReceiver: one request's leased blocks over the protocol
    pair_stats           PairBook: each pair's transport, probe / live GB/s, failures by cause
    protocol             header, chunks and acknowledgement over one channel
    staged               gloo channels carrying a GPU cache through pinned host memory (a pair on one GPU)
    gloo, nccl, inproc   the transports
    transport            the Channel / Transport interface
    lease                leases on exported blocks
    packing              blocks to and from contiguous buffers
    handle               KVHandle, KVLayout
    errors
"""

from kv_transfer.endpoints import KVReceiver, KVSender
from kv_transfer.errors import (EpochMismatchError, KVTransferError, LeaseExpiredError, PeerDiedError,
                                ProtocolError, ReceiverOutOfBlocksError, TransferTimeoutError)
from kv_transfer.factory import make_transport
from kv_transfer.handle import KVHandle, KVLayout
from kv_transfer.inproc import InProcHub, InProcTransport
from kv_transfer.lease import LeaseTable
from kv_transfer.packing import pack_blocks, unpack_blocks
from kv_transfer.transport import Channel, Transport

__all__ = [
    "KVHandle", "KVLayout", "LeaseTable", "KVSender", "KVReceiver", "pack_blocks", "unpack_blocks",
    "Transport", "Channel", "InProcHub", "InProcTransport", "make_transport",
    "KVTransferError", "LeaseExpiredError", "EpochMismatchError", "TransferTimeoutError", "PeerDiedError",
    "ReceiverOutOfBlocksError", "ProtocolError",
]
