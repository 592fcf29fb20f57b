"""The environment of a torch.distributed world of one process (a local profile, a checkpoint
export, an input sweep's one-rank job), as `init_process_group`'s env:// rendezvous reads it.

MASTER_PORT is 0: the only rank hosts the store and binds a port the kernel picks, holding it
from then on. A port found free beforehand (bound, closed, handed on) can be taken by another
process before torch binds it; CI once failed that way (EADDRINUSE).
"""

WORLD_OF_ONE: dict[str, str] = {
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "0",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
}
