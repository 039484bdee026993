"""The data lake: LeRobot v3.0 datasets read, written, decoded, mixed and packed on Ray Data.

Modules:
    format     LeRobot v3.0 layout; ``open_dataset`` (local paths and filesystem URIs)
    writer     ``LeRobotWriter`` / ``write_dataset``: parquet + mp4 (many episodes per file) + meta
    video      PyAV encoding presets (h264, AV1, lossless variants) and sequential decoding
    samples    one episode's samples: action chunk + mask, state, task, camera timestamps
    pipeline   ``Lake``: mixing, episode shuffle, decoder actor pool, skip accounting, packing
    report     ``inspect_dataset``: a dataset's shape and every problem found
    verify     ``verify_dataset``: decode every video, read every row group, name the episodes hit
    record     expert demonstrations from parallel env workers into a dataset
    synthetic  self-describing episodes for tests and benchmarks

The reading pipeline imports only message types, protocols, config and packing from ``rlvla3``;
``record`` (a policy may drive takes) builds policies lazily. What the lake costs is measured by
``measure.lake``.
``rlvla3 datalake inspect|record`` is ``commands.datalake``.
"""
