"""What a pod is handed after ADD, the files its containers read about their own rails:
pod_info.py computes, without I/O, the rails record and the NCCL/UCX environment from what ADD
learnt per rail; pod_cdi.py writes them where a runtime reads them (the JSON file under
podInfoDir, a CDI spec per granted unit) and removes them again at DEL and GC. The device plugin
reads pod_cdi's names for its placeholder specs. Modules here may import util/, kernel/ (the
address and GID types) and testhooks.py; never commands/, modes/, rails/ or grants/: the
commands hand them what to publish.
"""
