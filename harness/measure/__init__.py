"""The instrument: how baseline and candidate are timed against each other (harness.md, "How a
comparison is measured"), all in this package.

    driver.py         the parent: worker pairs, lockstep rounds, the records (the run's only writer)
    worker.py         a side worker: one long-lived process per side and pair, warmed once, timing bursts
    stopping.py       when a row is measured enough (half-width target or time budget)
    model.py          the records and messages driver and workers share, and their one JSON form
    detail/           mechanisms: the pipe, CUDA-graph capture and burst timing, NVML telemetry,
                      the autotune configs each worker's process chose
    call.py           calling a side's op and timing it: load_inputs, load_op, Call, Timer, peak_bytes, ...
                      (every measured process of the harness uses them: profile, ncu, warm, agreement too)
    sides.py          how a side's process is set up: BenchSettings, side_op, side_env (its env and the
                      shared Triton cache), training_job_row
    blocks.py         the first engine (`measure.engine: blocks`), its parent: the block plan and the loop
                      that runs each block in a fresh process
    blocks_worker.py  that engine's block worker: one block of one side, its records appended as it goes

The statistics the rounds feed are harness/stats.py's (nested: calls in bursts in rounds in pairs).
"""
