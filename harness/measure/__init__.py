"""The instrument: how baseline and candidate are timed against each other (harness.md, "How a
comparison is measured").

    driver.py    the parent: worker pairs, lockstep rounds, the records (the run's only writer)
    worker.py    a side worker: one long-lived process per side and pair, warmed once, timing bursts
    stopping.py  when a row is measured enough (half-width target or time budget)
    model.py     the records and messages driver and workers share, and their one JSON form
    detail/      mechanisms: the pipe, CUDA-graph capture and burst timing, NVML telemetry

The statistics the rounds feed are harness/stats.py's (nested: calls in bursts in rounds in pairs).
`measure.engine: blocks` selects the first engine instead (harness/bench.py: a fresh process per block).
"""
