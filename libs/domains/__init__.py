"""Domains: one folder per kind of task, holding everything that kind needs.

    libs/domains/<name>/
        __init__.py     DOMAIN = Domain(...): the parts below, found by the registry
        env.py          the environment: episodes, tools, its own task source
        rubric.py       how its rollouts are scored
        expert.py       a scripted expert for warm-start demonstrations (optional)
        harness.py      the harness limits its episodes need (optional)
        recipe.toml     the demo's recipe for it (optional)

Built-ins: arith, calc, recall, coding, dataset. Look one up through libs.domains.registry;
how to add your own: docs/domains.md.
"""
