"""The data plane: copy-based stage-to-stage hand-off over Unix stream sockets.

Its modules: `wire` (the items, their frames and the bytes that say what a frame is), `sender`
(`Sender`), `listener` (`Listener`), `shm` (the receivers' shared-memory pools, and the codec that
lays large values out in them) and `cuda_ipc` (CUDA tensors lent between processes on one GPU).

Each stage worker listens on `<data_dir>/<stage>.sock`. An upstream stage (or
the supervisor's feeder, for a pipeline's first stages) connects and sends one
`WorkItem` per frame; the receiver answers with one byte only once the item
has entered its bounded input queue (`ACK_ADMITTED`) or was dropped because
its job is already over (`ACK_DROPPED`). So a sender is blocked exactly while
the receiver's queue is at its high watermark: that is the backpressure.

Two ways to send. `Sender.send` (a job's whole outputs, `window = -1` edges, and
the jobs' own inputs) blocks while the receiver is full. `Sender.offer` (one
window of a streamed job, `window = N` edges) never waits: the receiver answers
at once, `ACK_FULL` when it has no room, and the sender offers it again later
while it sends other jobs' windows. So a receiver busy with one job's stream can
never block the windows that job is waiting for behind another job's.

Frames are an 8-byte big-endian length and a payload. Small items are a plain
pickle (protocol 5). Large values (tensors, arrays, bytes from `shm_min_bytes`)
cross through the receiver's shared-memory pool (`omnid.dataplane.shm`): the sender asks
for the pool once (`P`, answered with its memfd over SCM_RIGHTS), asks for room
(`R`: an offset, or FULL, which is backpressure like a full queue), copies the
values in, and sends the pickle that names them (`S`). The receiver builds them
on the pool's memory without copying.

A CUDA tensor for a receiver that sees its GPU goes by neither: the sender asks once per
connection which GPUs the receiver sees (`G`, answered with their UUIDs), lends such tensors
through CUDA IPC (`omnid.dataplane.cuda_ipc`) and sends the pickle that names them (`I`, or `S` beside
pool values); the receiver copies each one on that GPU before it answers. A receiver that cannot
open one answers `NO_IPC` instead of an acknowledgement, and the sender sends the item again by
the staged path.

Threads: `Sender.send` runs in the caller's thread and blocks on the socket
(polling `abandon()` every `POLL_S`); `Listener` runs one accept thread and
one reader thread per connection, each blocking in `recv` and in `admit`.
"""
