"""Measuring the package: worker launch and timing (``run``), peak memory (``memory``), collective traffic
(``collectives``) and the machine calibration behind ``lightning-p2r calibrate`` (``calibrate``).

These sit above the strategy and the planner and below the benchmarks and the tests, which import them downward:
nothing in ``strategy``, ``planning`` or ``layout`` imports from here.
"""
