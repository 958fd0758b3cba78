"""Reading TensorBoard event files back without TensorBoard: the records, and the purges a resume made.

An event file is a sequence of TFRecords (length, its CRC, an `Event` protobuf, its CRC); tensorboardX
ships the protobuf classes. TensorBoard reads a directory's files in name order, and a `SessionLog.START`
at step s (what `purge_step=s` writes) drops every earlier event of step >= s: so does `read_scalars`.
"""

from __future__ import annotations

import struct
from pathlib import Path


def events(path) -> list:
    """The Event messages of one file, in order; a record cut short at the end (a kill) ends the list."""
    from tensorboardX.proto.event_pb2 import Event

    found = []
    data = Path(path).read_bytes()
    offset = 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        start, end = offset + 12, offset + 12 + length
        if end + 4 > len(data):
            break
        event = Event()
        event.ParseFromString(data[start:end])
        found.append(event)
        offset = end + 4
    return found


def read_scalars(directory) -> dict[str, dict[int, list[float]]]:
    """{tag: {step: [values...]}} as TensorBoard shows them: files in name order, purges applied. A step
    with more than one value was written twice and not purged."""
    from tensorboardX.proto.event_pb2 import SessionLog

    scalars: dict[str, dict[int, list[float]]] = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        for event in events(path):
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for steps in scalars.values():
                    for step in [s for s in steps if s >= event.step]:
                        del steps[step]
            if event.HasField("summary"):
                for value in event.summary.value:
                    scalars.setdefault(value.tag, {}).setdefault(event.step, []).append(value.simple_value)
    return scalars
