from dcpc.cli import main

main()
