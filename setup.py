"""Package mapping that pyproject.toml alone cannot express.

The design brief fixes the top-level folders (proto/, common/, daemon/, agent/, migrations/) while
the import names are ours; the Alembic scripts in migrations/ must ship inside the wheel so an
installed daemon can upgrade its schema. setuptools' find() cannot rename a folder, so the
mapping is computed here.
"""

from setuptools import find_packages, setup

ROOTS = ["proto", "common", "daemon", "agent", "gateway"]

package_dir: dict[str, str] = {}
packages: list[str] = []
for root in ROOTS:
    for name in find_packages(root, include=["fleetshift*"]):
        packages.append(name)
        package_dir[name] = f"{root}/{name.replace('.', '/')}"
for name, folder in {
    "fleetshift_migrations": "migrations",
    "fleetshift_migrations.versions": "migrations/versions",
}.items():
    packages.append(name)
    package_dir[name] = folder

setup(packages=packages, package_dir=package_dir)
