"""Where runs keep their files, and the checkpoints among them.

Modules:
    files    checkpoint directories: save, locate, verify, fetch and load (weights, optimizer, meta)
    storage  ``Storage``: a local path or a filesystem URI (``s3://``, ``gs://``, ...) behind one
             interface, with the scratch cache downloads go to
"""
