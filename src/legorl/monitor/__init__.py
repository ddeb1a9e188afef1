"""Monitoring: what the agents do and why rollouts fail, live (see docs/monitoring.md).

- server.py      the dashboard web app (create_app, serve_dashboard); cli.py: `legorl dashboard`
- db.py          the dashboard's read side of the run store (indexes, pagination, incremental aggregates)
- analytics.py   what each page shows (chart specs, failure taxonomy, behaviour per step, alarm board)
- trajectory.py  one rollout token by token: new prompt parts, logprobs, tool calls and results
- behaviour.py   behaviour metrics from captured calls, any harness; commands.py classifies tool calls
- messages.py    the conversation inside a stored request, for every wire format
- alarms.py      mismatch KL rising, tool calls collapsing, zero-variance groups, infrastructure failures
- loggers.py     step metrics to TensorBoard / W&B (offline) / MLflow
- synthetic.py   a large synthetic store for the benchmark and tests

Nothing is imported here: `import legorl.monitor.cli` stays cheap for the command line.
"""
