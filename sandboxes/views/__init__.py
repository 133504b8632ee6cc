"""The console's pages about sandboxes, launches, templates, snapshots and network policies.

Each view is wrapped in ``console.access.team_view`` (signed in, a member of
the session's team, the role it needs), finds the team's objects with
``selectors`` (another team's are a 404) and calls the services the API
calls.  A refusal (``console.errors.Refused``) is shown as its message.
"""
