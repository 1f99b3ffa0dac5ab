from steadylm.diagnose.cli import main

main()
