"""Lines the Podman test wants shown at the end of the run (versions, start times, sample path)."""

PODMAN_REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if PODMAN_REPORT:
        terminalreporter.section("podman (CNI backend) with rdma-netns")
        for line in PODMAN_REPORT:
            terminalreporter.write_line(line)
