"""For nbval's runs of these notebooks.

After a cell has run, nbval reads its output messages from the kernel and gives up when 5 s pass
without one (a fixed number in nbval). ``make test`` runs nbval beside the other checks on 2 cores,
where a busy machine once kept a kernel's messages back for longer than that after a long training
cell: the cell had run, and failed as "Timeout of 5 seconds exceeded waiting for output". A minute
leaves room for a busy machine; a cell that really hangs is still stopped by --nbval-cell-timeout.
"""

OUTPUT_TIMEOUT_S = 60


def pytest_collection_modifyitems(items):
    for item in items:
        if hasattr(item, "output_timeout"):
            item.output_timeout = OUTPUT_TIMEOUT_S
