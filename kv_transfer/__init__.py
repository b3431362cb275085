"""KV-cache transfer between prefill and decode workers: leases, packing, transports, protocol.

No Ray in here; deployments/kv_endpoint.py is the Ray glue.
"""

from kv_transfer.endpoints import KVReceiver, KVSender
from kv_transfer.errors import (EpochMismatchError, KVTransferError, LeaseExpiredError, PeerDiedError,
                                ProtocolError, ReceiverOutOfBlocksError, TransferTimeoutError)
from kv_transfer.handle import KVHandle, KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.packing import pack_blocks, unpack_blocks
from kv_transfer.transport import Channel, InProcHub, InProcTransport, Transport, make_transport

__all__ = [
    "KVHandle", "KVLayout", "LeaseTable", "KVSender", "KVReceiver", "pack_blocks", "unpack_blocks",
    "Transport", "Channel", "InProcHub", "InProcTransport", "make_transport",
    "KVTransferError", "LeaseExpiredError", "EpochMismatchError", "TransferTimeoutError", "PeerDiedError",
    "ReceiverOutOfBlocksError", "ProtocolError",
]
