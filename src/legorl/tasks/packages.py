"""The bundled package list for ``legorl tasks synth --bundled`` (exact pins).

Small pure-Python packages whose sdists ship their tests and whose suites pass offline with
pytest and the test dependencies their sdists declare (built once per package into its task
environment, ``legorl.tasks.envs``); chosen by running each candidate's suite the way ``synth``
does (BENCHMARKS.md, "Real tasks"). Test files that fail to collect or report subtests are left
out per file. click, isodate, parse, pathspec and pyflakes were added after a plain run of each
suite: 0.5-5 s, all or all but one file passing.

Measured and left out: docopt 0.6.2, sortedcontainers 2.4.0 and tomli 2.5.0 (their sdists ship
no tests), jmespath 1.1.0 (its sdist lacks ``tests/__init__.py``: every test module fails to
import), wcwidth 0.9.4 (its tests expect the C extension), attrs 26.1.0 (a 127 s suite),
more-itertools 11.2.1 and idna 3.20 (44 s and 17 s suites, mostly subtests), pyparsing 3.3.3
(its suite with line tracing ran past 15 minutes); python-dateutil 2.9.0.post0 (3 collection
errors in a plain run), jinja2 3.1.6 (a 10 s suite; kept in reserve).
"""

BUNDLED_PACKAGES: tuple[str, ...] = (
    "boltons==26.2.0",
    "cachetools==8.0.2",
    "click==8.1.8",
    "humanize==4.17.0",
    "inflection==0.5.1",
    "isodate==0.7.2",
    "itsdangerous==2.2.0",
    "parse==1.20.2",
    "pathspec==0.12.1",
    "pyflakes==3.2.0",
    "python-slugify==9.2.0",
    "semver==3.1.2",
    "simplejson==4.3.0",
    "six==1.17.0",
    "tabulate==0.10.0",
    "text-unidecode==1.3",
    "toolz==1.2.0",
)
