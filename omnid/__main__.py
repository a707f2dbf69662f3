from omnid.cli import main

main()
