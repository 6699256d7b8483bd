"""Helpers below every other layer, on the standard library's C-level modules where the hot path
needs them: paths (paths.py: os.path on posix alone), private files and atomic writes (fsutil.py),
the trust walk for the folders and FIFO a config names (trusted_paths.py), the JSON codec on
`_json` (jsonio.py), and the readiness files exec probes read (probe_file.py). Modules here import
the standard library and each other only: no config, no kernel, no CNI policy, nothing of the
device plugin; both programs and every layer of this package may import them.
"""
