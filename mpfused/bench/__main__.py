from mpfused.bench.cli import main

main()
