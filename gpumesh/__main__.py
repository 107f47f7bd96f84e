from gpumesh.cli.main import main

main(prog_name="gpumesh")
