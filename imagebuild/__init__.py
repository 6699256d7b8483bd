"""Build the DaemonSet's image on this machine from Debian and PyPI packages only (no registry):
scripts/build-image.sh runs `python3 -m imagebuild`. See imagebuild/__main__.py for the steps."""
