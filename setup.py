"""Ships the checkout's recipes/ inside the package (dspark_kit/recipes/), so an installed kit runs
`dspark-kit run tiny-cpu` from any folder. Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

RECIPES = Path(__file__).resolve().parent / "recipes"


class BuildWithRecipes(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "dspark_kit" / "recipes"
        self.mkpath(str(target))
        for recipe in sorted(RECIPES.glob("*.yaml")):
            self.copy_file(str(recipe), str(target / recipe.name))


setup(cmdclass={"build_py": BuildWithRecipes})
