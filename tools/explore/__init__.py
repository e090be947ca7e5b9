"""The race explorer (``tickloom explore``): seeded schedules, every run checked, a violation shrunk and handed over.

One driver, two levels:

* ``driver``: the loop over seeds, shrinking (``ddmin``), ``Found``, the replay token, the kept log, the report and
  the regression test; a level is the small ``driver.Level`` protocol it calls;
* ``core`` (with ``core_schedule``): the real ``SchedulerCore`` in the simulator (``replay.sim``), each completion
  moved by a seeded strategy (``replay.policy``); no trio;
* ``actors`` (with ``schedule`` and ``script``): the real trio actors and ``Engine`` on the stub device under
  ``MockClock``, trio's scheduler seeded through its private hook (``tickloom[explore]`` pins a trio that has it);
* ``checks``: the one ``Violation`` and both levels' checks; ``variants``: both levels' deliberately broken copies,
  which the tests plant for the explorer to find; ``levels``: the levels by name, and ``replay_token``.

The command (``tools.commands.explore``) only parses arguments and prints.
"""
